"""estimate(): per-layer costs of one training step on a GPU we do not have, from meta runs.

The model is built on the ``meta`` device (no memory, no arithmetic) and one training step
runs block by block (pipeswap.profiling.step). A dispatch mode sees every aten op:

- FLOPs come from ``torch.utils.flop_counter``'s formulas (matmul, conv, attention);
- bytes moved are the op's tensor inputs plus outputs;
- each op takes ``max(flops / (peak * matmul_eff), bytes / (hbm * memory_eff)) + launch_s``
  (a roofline per op): matrix ops are compute-bound, elementwise and normalisation ops
  memory-bound. Views and allocations cost nothing.

Saved tensors come from the same capture a measured run uses, so they match a CPU run
layer by layer and index by index.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import GpuSpec, gpu_spec
from pipeswap.models import build_model, shape_defaults
from pipeswap.models.base import LayeredModel
from pipeswap.models.state import untouched
from pipeswap.optim import PROFILE_OPTIMIZER
from pipeswap.profiling.meta_attention import meta_attention_like_cpu
from pipeswap.profiling.metered_step import layered_step_memory
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor
from pipeswap.profiling.saved import SavedTensorCapture
from pipeswap.profiling.step import (
    dtype_name,
    ensure_layered,
    example_batch,
    optimizer_state_bytes,
    param_bytes_by_layer,
    parse_dtype,
    run_step,
    step_profile,
)

__all__ = [
    "Efficiency",
    "aten",
    "estimate",
    "meta_copy",
    "moved_copy",
    "on_device",
]


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that real layers reach, per op class.

    Defaults: large GEMMs reach ~80% of the bf16 peak on an H200 (hardware.md: 790 of 989
    TFLOP/s) but real layers are smaller and less regular, so matrix ops get 0.6; device
    copies reach ~90% of HBM bandwidth (4.3 of 4.8 TB/s), elementwise kernels less: 0.7.
    Each kernel also pays a launch cost.
    """

    matmul: float = 0.6
    memory: float = 0.7
    launch_s: float = 5e-6

    def to_json(self) -> dict[str, float]:
        return {"matmul": self.matmul, "memory": self.memory, "launch_s": self.launch_s}


aten = torch.ops.aten


def _flash_cpu_flops(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
    return flop_counter.sdpa_flop_count(q.shape, k.shape, v.shape)


def _flash_cpu_backward_flops(
    grad: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)


# PyTorch's registry has the CUDA attention kernels; add the CPU flash kernel the meta run
# uses (see pipeswap.profiling.meta_attention.meta_attention_like_cpu). Like PyTorch's formulas these
# count full attention even when it is causal.
_FLOPS: dict[Any, Any] = {
    **flop_counter.flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flops,
}

# Ops that only allocate or relabel memory: no kernel worth timing.
_FREE = {
    aten.empty,
    aten.empty_strided,
    aten.empty_like,
    aten.new_empty,
    aten.new_empty_strided,
    aten.detach,
    aten.alias,
    aten._unsafe_view,
    aten.lift_fresh,
    aten.resize_,
    aten.set_,
    aten.scalar_tensor,
    aten._local_scalar_dense,
}


def _tensor_bytes(tree: Any) -> int:
    leaves, _ = tree_flatten(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@dataclass
class _Cost:
    flops: int = 0
    seconds: float = 0.0
    bytes: int = 0


class _CostCounter(TorchDispatchMode):
    """Adds each aten op's FLOPs, bytes and roofline time to the current (layer, phase)."""

    def __init__(self, spec: GpuSpec, dtype: str, efficiency: Efficiency) -> None:
        super().__init__()
        self.peak = spec.peak_flops(dtype)
        self.bandwidth = spec.hbm_bytes_per_s
        self.efficiency = efficiency
        self.where: tuple[str, str] | None = None
        self.costs: dict[tuple[str, str], _Cost] = defaultdict(_Cost)

    @contextmanager
    def at(self, name: str, phase: str) -> Iterator[None]:
        self.where = (name, phase)
        try:
            yield
        finally:
            self.where = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if self.where is None or func.is_view or packet in _FREE:
            return out
        formula = _FLOPS.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        eff = self.efficiency
        seconds = max(flops / (self.peak * eff.matmul), moved / (self.bandwidth * eff.memory))
        cost = self.costs[self.where]
        cost.flops += flops
        cost.bytes += moved
        cost.seconds += seconds + eff.launch_s
        return out


def moved_copy(
    model: LayeredModel, device: torch.device | str, dtype: torch.dtype | None = None
) -> LayeredModel:
    """A copy of ``model`` on ``device``, floating-point tensors in ``dtype`` (if given).

    The original is not touched. Tied parameters stay tied; every buffer is a fresh copy
    (a training forward writes BatchNorm statistics), while a parameter already on
    ``device`` in ``dtype`` may share its storage (a step without an optimizer never
    writes parameters).
    """

    def moved(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        return tensor.detach().to(device=device, dtype=cast, copy=copy)

    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(moved(param, False), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = moved(buffer, True)
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - any failure means the same advice
        raise PipeswapError(
            f"cannot copy {model.name} to {device} for profiling ({type(exc).__name__}: "
            f"{exc}); move the model there yourself (model.to(...)) and profile it in place"
        ) from exc


def meta_copy(model: LayeredModel) -> LayeredModel:
    """A copy of ``model`` on the meta device (parameters and buffers become meta tensors)."""
    return moved_copy(model, "meta")


def on_device(model: LayeredModel, device: torch.device, dtype: torch.dtype) -> bool:
    """True when every parameter and buffer is on ``device`` and every floating one is in
    ``dtype``: the model can then be profiled in place."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return all(
        t.device == device and (t.dtype == dtype or not t.is_floating_point())
        for t in (*model.parameters(), *model.buffers())
    )


def estimate(
    model: nn.Module | str,
    batch: int,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    gpu: str | GpuSpec = "v100-32gb",
    dtype: str = "float32",
    optimizer: str = PROFILE_OPTIMIZER,
    efficiency: Efficiency | None = None,
) -> Profile:
    """Estimate a training step of ``model`` on ``gpu`` without running it: it runs on the
    meta device.

    ``model`` is an ``nn.Module`` (a LayeredModel, or any module, which
    pipeswap.models.adapt cuts at its blocks) or a model's name (a zoo name, a Hugging Face
    directory or ``module:function``), built on meta; for a name, ``seq_len`` /
    ``image_size`` default to the model's defaults. A module already on meta in ``dtype``
    runs in place (and is left as it was found); any other runs as a meta copy in ``dtype``
    (which allocates nothing). float32 uses the GPU's FP32 peak (no TF32), bfloat16/float16
    its tensor-core peak.
    """
    spec = gpu if isinstance(gpu, GpuSpec) else gpu_spec(gpu)
    torch_dtype = parse_dtype(dtype)
    if isinstance(model, str):
        seq_len, image_size = shape_defaults(model, seq_len, image_size)
        model = build_model(model, device="meta", dtype=torch_dtype, image_size=image_size)
    model = ensure_layered(model, "estimate")
    name_of_dtype = dtype_name(torch_dtype)
    optimizer_state_bytes(optimizer, 0)  # refuse an unknown optimizer before any work
    efficiency = efficiency or Efficiency()
    if batch < 1:
        raise ConfigError(f"{{batch}} must be at least 1, not {batch}")
    if not on_device(model, torch.device("meta"), torch_dtype):
        model = moved_copy(model, "meta", torch_dtype)
    inputs, targets = example_batch(model, batch, seq_len, image_size, "meta", torch_dtype)
    counter = _CostCounter(spec, name_of_dtype, efficiency)
    with untouched(model):
        model.train()
        with meta_attention_like_cpu(), counter, SavedTensorCapture(model) as capture:
            shapes = run_step(model, inputs, targets, counter.at)
    records = capture.records()
    params = param_bytes_by_layer(model)
    with untouched(model):
        model.train()
        memory = layered_step_memory(model, inputs, targets, torch.device("meta"), optimizer)
    layers = []
    for name in model.layer_names:
        forward, backward = counter.costs[(name, "forward")], counter.costs[(name, "backward")]
        layers.append(
            LayerProfile(
                name=name,
                forward_s=forward.seconds,
                backward_s=backward.seconds,
                param_bytes=params[name],
                output_bytes=shapes.output_bytes[name],
                saved=tuple(SavedTensor(r.index, r.bytes) for r in records[name]),
                forward_flops=forward.flops,
                backward_flops=backward.flops,
            )
        )
    return step_profile(
        model,
        batch,
        seq_len,
        image_size,
        optimizer,
        layers,
        dtype=name_of_dtype,
        source="estimate",
        device=spec.name,
        memory=memory,
        notes={
            "gpu": spec.to_json(),
            "memory": "the live storages of one whole-model step on meta (sizes without "
            "data), read at every layer's edges as pipeswap.profiling.measure reads a real "
            "one; no allocator rounding",
            "peak_flops": spec.peak_flops(name_of_dtype),
            "efficiency": efficiency.to_json(),
            "time_model": "per aten op: max(flops / (peak_flops * matmul), bytes moved / "
            "(hbm_bytes_per_s * memory)) + launch_s; views and allocations are free",
            "flops": "torch.utils.flop_counter formulas (attention counted in full even "
            "when causal)",
            "saved": "distinct non-parameter storages autograd saves on meta, attention run "
            "as the CPU would (pipeswap.profiling.saved)",
            "optimizer": "sgd is SGD with momentum (1 buffer per parameter); adam and adamw keep 2",
            "workspace_bytes": "not estimated (0)",
        },
    )
