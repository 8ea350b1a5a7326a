"""measure(): per-layer costs of one training step, timed on a real CPU or CUDA device."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.models import build_model, shape_defaults
from pipeswap.models.base import LayeredModel
from pipeswap.models.state import untouched
from pipeswap.optim import PROFILE_OPTIMIZER
from pipeswap.profiling.estimate import estimate, meta_copy, moved_copy, on_device
from pipeswap.profiling.metered_step import layered_step_memory
from pipeswap.profiling.on_host import SavedOnHost, every_saved_tensor_on_host
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor
from pipeswap.profiling.saved import SavedTensorCapture
from pipeswap.profiling.step import (
    dtype_name,
    ensure_layered,
    example_batch,
    is_allocation_error,
    optimizer_state_bytes,
    param_bytes_by_layer,
    parse_dtype,
    run_step,
    step_profile,
)
from pipeswap.profiling.update_step import update_seconds
from pipeswap.units import format_bytes

__all__ = ["measure", "requested_bytes", "transient_bytes"]

_TIMING_NOTE = (
    "forward_s/backward_s: median over repeats of each block's own pass; the step runs block "
    "by block (each block's input, or each member of a tuple input that needs a gradient, a "
    "non-leaf sharing the previous output's storage, cut from the graph before it; each "
    "block's backward a separate autograd.backward), wall clock around each pass with "
    "torch.cuda.synchronize() on CUDA; the loss belongs to the last layer"
)
_SAVED_NOTE = (
    "saved: distinct non-parameter storages autograd saves, bytes = storage nbytes, owned by "
    "the last layer whose forward saved them (pipeswap.profiling.saved)"
)
_OPTIMIZER_NOTE = "sgd is SGD with momentum (1 buffer per parameter); adam and adamw keep 2"
_UPDATE_NOTE = (
    "median wall time of optimizer.step() over the trainable parameters, with gradients of "
    "1e-3 (the optimizer every mode builds: OptimizerConfig.build), after one step that "
    "creates its state, stepped on aliases of their storage and their values put back "
    "afterwards from host memory (profiling.update_step); null when it did not fit in memory"
)
_MEMORY_NOTE = (
    "memory: the device's own meter (CUDA's allocator; elsewhere the live storages, as "
    "torch's MemTracker counts them) read at every layer's edges during one whole-model "
    "forward and backward; the optimizer state (not made here) is added to every reading, "
    "and the step's peak is the state, the gradients and one optimizer step's temporaries "
    "(over the parameters, put back afterwards)"
)


def _check_device(device: torch.device) -> None:
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "CUDA is not available on this machine (PyTorch sees no GPU); measure on "
            "{device} cpu, or estimate a GPU run with {estimate} {gpu} SPEC"
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"cannot measure on {{device}} {device}; use cpu or cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transient_bytes(before: int, peak: int, after: int) -> int:
    """Memory a pass needed beyond what it held at its start and at its end.

    The larger end counts because a forward keeps its output and saved tensors, and a
    backward held its layer's saved tensors when it started (it frees them as it goes):
    the profile counts those as saved bytes, so they must not count as workspace too.
    """
    return max(0, peak - max(before, after))


class _Timer:
    """Wall-clock time of each (layer, phase) pass, plus CUDA transient memory."""

    def __init__(self, device: torch.device, on_host: SavedOnHost | None = None) -> None:
        self.device = device
        self.on_host = on_host
        self.seconds: dict[tuple[str, str], float] = {}
        self.transient: dict[str, int] = {}

    @contextmanager
    def __call__(self, name: str, phase: str) -> Iterator[None]:
        cuda = self.device.type == "cuda"
        if self.on_host is not None:
            # Saved tensors on the host: the copies a pass makes at its edges (the layer
            # before's to the host, this layer's back) are made before it is timed, so
            # the pass starts holding what it holds in the step as it is.
            if phase == "forward":
                self.on_host.entering(name)
            else:
                self.on_host.bring_back(name)
        # Kernels run asynchronously: drain the queue on both sides of the pass so the
        # wall clock covers exactly its kernels.
        _sync(self.device)
        before = 0
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        yield
        _sync(self.device)
        self.seconds[(name, phase)] = time.perf_counter() - start
        if cuda:
            extra = transient_bytes(
                before,
                torch.cuda.max_memory_allocated(self.device),
                torch.cuda.memory_allocated(self.device),
            )
            self.transient[name] = max(self.transient.get(name, 0), extra)


@dataclass(frozen=True)
class _Step:
    """The training step measure() profiles: a model, its batch, on a device in a dtype,
    and the optimizer whose state it counts."""

    model: LayeredModel
    batch: int
    seq_len: int | None
    image_size: int | None
    device: torch.device
    dtype: torch.dtype
    optimizer: str

    def example(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = example_batch(
            self.model, self.batch, self.seq_len, self.image_size, self.device, self.dtype
        )
        # Fresh compact storages, as a host-to-device copy of the batch would give.
        return inputs.clone(memory_format=torch.contiguous_format), targets.clone()


def measure(
    model: nn.Module | str,
    batch: int,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str = torch.float32,
    optimizer: str = PROFILE_OPTIMIZER,
    warmup: int = 1,
    repeats: int = 3,
    saved_on_host: bool = False,
) -> Profile:
    """Run real training steps of ``model`` and profile them.

    ``model`` is an ``nn.Module`` (a LayeredModel, or any module, which
    pipeswap.models.adapt cuts at its blocks) or a model's name (a zoo name, a Hugging Face
    directory or ``module:function``). A module is left as it was found: parameters
    (values, gradients, requires_grad), buffers, every submodule's train/eval mode, and the
    CPU and CUDA random generators. It is measured in place when it is already on
    ``device`` in ``dtype``, otherwise on a copy moved there. For a name, ``seq_len`` /
    ``image_size`` default to the model's defaults. Run it inside ``torch.autocast`` to
    profile mixed precision (the profile's notes say so). An allocation failure becomes a
    ConfigError (a PipeswapError) naming the memory a meta
    estimate says the step needs and the allocation that failed (when the allocator
    says), and suggesting a smaller batch.

    ``saved_on_host``: every step runs within the memory of a plan that swaps every saved
    tensor (pipeswap.profiling.on_host), not at the no-swap peak, for a run whose budget is
    below it; the profile is the same (the meter reads what the step as it is holds), but
    for the copies' effect on the timings.
    """
    if not isinstance(model, str):
        model = ensure_layered(model, "measure")
    torch_dtype = parse_dtype(dtype)
    torch_device = torch.device(device)
    _check_device(torch_device)
    optimizer_state_bytes(optimizer, 0)  # refuse an unknown optimizer before any work
    if batch < 1 or repeats < 1 or warmup < 0:
        raise ConfigError(
            f"need {{batch}} >= 1, repeats >= 1 and warmup >= 0 (got {batch}, {repeats}, {warmup})"
        )
    # A model built here from its name is ours to change, but the random generators are
    # the user's either way.
    mine = model if isinstance(model, LayeredModel) else nn.Module()
    with untouched(mine, [torch_device]):
        if isinstance(model, str):
            seq_len, image_size = shape_defaults(model, seq_len, image_size)
            target = build_model(
                model, device=torch_device, dtype=torch_dtype, image_size=image_size
            )
        elif on_device(model, torch_device, torch_dtype):
            target = model
        else:
            target = moved_copy(model, torch_device, torch_dtype)
        step = _Step(target, batch, seq_len, image_size, torch_device, torch_dtype, optimizer)
        try:
            return _measure(step, warmup, repeats, saved_on_host)
        except (RuntimeError, MemoryError) as exc:
            if not is_allocation_error(exc):
                raise
            # Dropping the traceback lets the failed step's tensors (its frames hold them) go.
            failure = exc.with_traceback(None)
    raise _does_not_fit(step, failure)


def _does_not_fit(step: _Step, exc: BaseException) -> ConfigError:
    """The refusal of a batch whose training step ran out of memory on its device."""
    try:
        needed: int | None = estimate(
            meta_copy(step.model),
            step.batch,
            seq_len=step.seq_len,
            image_size=step.image_size,
            dtype=dtype_name(step.dtype),
            optimizer=step.optimizer,
        ).peak_training_bytes()
    except Exception:  # noqa: BLE001 - the estimate only adds detail to the real error
        needed = None
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    requested = requested_bytes(text)
    parts = []
    if needed is not None:
        parts.append(f"one training step needs about {format_bytes(needed)} (meta estimate)")
    if requested is not None:
        parts.append(f"a single allocation of {requested} failed")
    need = f"{' and '.join(parts)}: " if parts else ""
    return ConfigError(
        f"{step.model.name} at batch {step.batch} does not fit on {step.device}: "
        f"{need}out of memory ({first_line}); try a smaller {{batch}} or {{estimate}} "
        "{gpu} SPEC to profile without running"
    )


_REQUESTED = (
    re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE),  # CPU allocator
    re.compile(r"tried to allocate ([0-9.]+ ?[KMGTP]?i?B)", re.IGNORECASE),  # CUDA allocator
)


def requested_bytes(message: str) -> str | None:
    """The size an allocator says it failed to allocate ("64.00 GiB", "20.00 MiB"), if it says."""
    bytes_only, sized = _REQUESTED
    match = bytes_only.search(message)
    if match is not None:
        return format_bytes(int(match.group(1)))
    match = sized.search(message)
    return None if match is None else match.group(1)


def _autocast_dtype(device: torch.device) -> str | None:
    """The dtype torch.autocast runs ``device``'s ops in around this call, or None."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return dtype_name(torch.get_autocast_dtype(device.type))


def _measure(step: _Step, warmup: int, repeats: int, saved_on_host: bool) -> Profile:
    model, device, optimizer = step.model, step.device, step.optimizer
    model.train()
    inputs, targets = step.example()
    children = dict(model.named_children())
    blocks = {name: children[name] for name in model.layer_names}

    def zero_grads() -> None:
        for param in model.parameters():
            param.grad = None

    def timed_step() -> _Timer:
        on_host = (
            # autocast's cache as the step as it is keeps it: its readings are profiled
            every_saved_tensor_on_host(model, blocks, drop_casts=False)
            if saved_on_host
            else nullcontext()
        )
        with on_host as held:
            timer = _Timer(device, held)
            run_step(model, inputs, targets, timer)
        zero_grads()
        return timer

    zero_grads()  # the user's gradients are put back afterwards; none may add to them
    # One untimed step names the saved tensors and tracks their liveness (with them on
    # the host, a forward that lets go of them as it runs).
    with SavedTensorCapture(model, release=saved_on_host) as capture:
        shapes = run_step(model, inputs, targets, backward=not saved_on_host)
    records = capture.records()
    zero_grads()
    for _ in range(warmup):
        timed_step()
    timings = [timed_step() for _ in range(repeats)]

    trainable = [p for p in model.parameters() if p.requires_grad]
    update_s = update_seconds(trainable, optimizer, device, warmup, repeats)
    params = param_bytes_by_layer(model)
    memory = layered_step_memory(
        model, inputs, targets, device, optimizer, saved_on_host=saved_on_host
    )
    zero_grads()
    layers = []
    for name in model.layer_names:
        layers.append(
            LayerProfile(
                name=name,
                forward_s=statistics.median(t.seconds[(name, "forward")] for t in timings),
                backward_s=statistics.median(t.seconds[(name, "backward")] for t in timings),
                param_bytes=params[name],
                output_bytes=shapes.output_bytes[name],
                saved=tuple(SavedTensor(r.index, r.bytes) for r in records[name]),
                workspace_bytes=max((t.transient.get(name, 0) for t in timings), default=0),
            )
        )
    return step_profile(
        model,
        step.batch,
        step.seq_len,
        step.image_size,
        optimizer,
        layers,
        dtype=dtype_name(step.dtype),
        source="measured",
        device=device.type,
        optimizer_step_s=update_s,
        memory=memory,
        notes={
            "timing": _TIMING_NOTE,
            "memory": _MEMORY_NOTE,
            "saved": _SAVED_NOTE,
            "optimizer": _OPTIMIZER_NOTE,
            "optimizer_step_s": _UPDATE_NOTE,
            "workspace": "CUDA: peak allocated during a pass minus the larger of allocated "
            "before and after it (forward and backward); 0 on CPU (no allocator statistics)",
            "peak_live_saved_bytes": capture.peak_live_bytes,
            "saved_on_host": saved_on_host,
            "warmup": warmup,
            "repeats": repeats,
            "loss": shapes.loss,
            "autocast": _autocast_dtype(device),
        },
    )
