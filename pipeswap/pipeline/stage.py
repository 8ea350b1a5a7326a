"""One stage's compute: its layers, what crosses its cuts, forward and backward of units."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeswap.errors import PipeswapError
from pipeswap.loss_share import LossShares
from pipeswap.models.base import evaluating
from pipeswap.models.meta_ops import meta_like_real
from pipeswap.pipeline.job import build_full_model, build_meta_model
from pipeswap.precision import DEFAULT_PRECISION, autocast
from pipeswap.profiling.profile import LayerProfile, Profile
from pipeswap.schedule.partition import check_stage_count
from pipeswap.train_config import TrainConfig

__all__ = [
    "BoundarySpec",
    "LayerInfo",
    "Packed",
    "StageRunner",
    "TensorSpec",
    "flop_profile",
    "inspect_layers",
    "layer_infos",
    "pack",
    "unpack",
]

# What travels between stages: a tensor, or a tuple of tensors, packed as a tuple.
Packed = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class BoundarySpec:
    """What one layer hands to the next: a tensor (``is_tuple`` False) or a tuple of tensors.

    Floating-point tensors carry gradients back; integer ones (token ids, masks) do not.
    """

    is_tuple: bool
    tensors: tuple[TensorSpec, ...]

    @property
    def grad_indices(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.tensors) if t.dtype.is_floating_point)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def empty(self, device: torch.device | str = "cpu", *, grads: bool = False) -> Packed:
        """Receive buffers for the activations (or, with ``grads``, their gradients)."""
        chosen = self.grad_indices if grads else range(len(self.tensors))
        return tuple(
            torch.empty(self.tensors[i].shape, dtype=self.tensors[i].dtype, device=device)
            for i in chosen
        )


@dataclass(frozen=True)
class LayerInfo:
    """Static facts about one layer at the micro-batch size, found on the meta device."""

    name: str
    output: BoundarySpec
    forward_flops: int
    param_bytes: int


def pack(value: Any, where: str) -> Packed:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return value
    raise PipeswapError(
        f"{where} returns {type(value).__name__}, but pipeline stages pass a tensor or a tuple "
        f"of tensors between layers: make it return one of those"
    )


def unpack(tensors: Packed, spec: BoundarySpec) -> Any:
    return tensors if spec.is_tuple else tensors[0]


def inspect_layers(config: TrainConfig) -> list[LayerInfo]:
    """Run the model on the meta device one layer at a time: output specs and FLOPs.

    Under mixed precision the dtypes come from a real forward under autocast (the meta
    device does not autocast), so receive buffers match what a stage sends.
    Raises PipeswapError naming the first layer whose output is not a tensor or a tuple
    of tensors, and when the model has fewer layers than the pipeline has stages.
    """
    model = build_meta_model(config)
    check_stage_count(
        len(model), config.require_pipeline().num_stages, model.layer_names, config.model
    )
    value, _ = model.example_batch(
        config.micro_batch_size, seq_len=config.seq_len, image_size=config.image_size, device="meta"
    )
    infos = layer_infos(model, value, config.model)
    if config.precision == "fp32":
        return infos
    return [
        replace(
            info,
            output=replace(
                info.output,
                tensors=tuple(replace(t, dtype=d) for t, d in zip(info.output.tensors, dtypes)),
            ),
        )
        for info, dtypes in zip(infos, _autocast_dtypes(config))
    ]


def layer_infos(model: nn.Module, value: Any, where: str) -> list[LayerInfo]:
    """Each layer of ``model`` run on ``value`` in turn, without gradients: what it hands
    on (its output's specs) and its FLOPs. Meta tensors give shapes at no cost; real ones
    (under the caller's autocast) also the dtypes a run sends. Meta ops take what their
    real kernels take (pipeswap.models.meta_ops), so a model that trains is inspected."""
    infos = []
    for name, layer in model.named_children():
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad(), meta_like_real():
            value = layer(value)
        tensors = pack(value, f"layer {name!r} of {where}")
        spec = BoundarySpec(
            isinstance(value, tuple), tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        )
        param_bytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        infos.append(LayerInfo(name, spec, int(counter.get_total_flops()), param_bytes))
    return infos


def _autocast_dtypes(config: TrainConfig) -> list[tuple[torch.dtype, ...]]:
    """The dtypes each layer's outputs have under the run's autocast: one sample through
    the real model on the run's device, without gradients."""
    device = torch.device(config.device or "cpu")
    model = build_full_model(config, device)
    value, _ = model.example_batch(
        1, seq_len=config.seq_len, image_size=config.image_size, device=device
    )
    found = []
    with torch.no_grad(), autocast(config.precision, device):
        for name, layer in model.named_children():
            value = layer(value)
            found.append(tuple(t.dtype for t in pack(value, f"layer {name!r}")))
    return found


def flop_profile(config: TrainConfig, infos: list[LayerInfo]) -> Profile:
    """A deterministic Profile from FLOP counts (at a nominal 1 TFLOP/s, backward = 2x forward).

    Used to pick the default balance: unlike timings it is the same on every rank and run.
    """
    micro_batches = config.require_pipeline().micro_batch_count
    scale = micro_batches * 1e-12
    layers = tuple(
        LayerProfile(
            info.name,
            info.forward_flops * scale,
            2 * info.forward_flops * scale,
            info.param_bytes,
            info.output.nbytes * micro_batches,
            forward_flops=info.forward_flops * micro_batches,
            backward_flops=2 * info.forward_flops * micro_batches,
        )
        for info in infos
    )
    return Profile(
        config.model,
        config.batch or 1,
        "float32",
        "estimate",
        "flops",
        config.optim.name,
        0,
        layers,
        seq_len=config.seq_len,
        image_size=config.image_size,
        has_saved_data=False,
        notes={"costs": "FLOPs counted on the meta device at a nominal 1 TFLOP/s"},
    )


class StageRunner:
    """Forward and backward of units on one stage, keeping each unit's graph until its backward.

    Stage 0 takes the model's input; later stages take the packed activations they
    received and return the packed gradients of those activations. The last stage
    computes the loss, scaled by 1/micro_batches so the summed gradients are those of the
    mini-batch mean.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        module: nn.Module,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        *,
        micro_batches: int,
        input_spec: BoundarySpec | None,
        output_spec: BoundarySpec | None,
        task: str = "lm",
        precision: str = DEFAULT_PRECISION,
        device: torch.device | str = "cpu",
    ) -> None:
        self.index = index
        self.num_stages = num_stages
        self.module = module
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.task = task
        self.precision = precision
        self.device = torch.device(device)
        self.losses: dict[int, float] = {}
        self._pending: dict[int, tuple[Packed, Packed]] = {}
        # On the last stage: a context its forward runs in, given the unit's target (the
        # model's own loss from labels, pipeswap.models.replay.Replay.labelled).
        self.labelled: Callable[[torch.Tensor], AbstractContextManager[None]] | None = None
        # On the last stage: each unit's share of its mini-batch's scored items, where they
        # differ (pipeswap.loss_share); None: every unit weighs 1/micro_batches.
        self.shares: LossShares | None = None

    def _labels(self, target: torch.Tensor | None) -> AbstractContextManager[None]:
        if self.labelled is None or target is None or not self.is_last:
            return nullcontext()
        return self.labelled(target)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def _input_value(self, inputs: Any) -> tuple[Any, Packed]:
        if self.is_first:
            return inputs, ()
        assert self.input_spec is not None
        leaves = tuple(t.requires_grad_(True) if t.dtype.is_floating_point else t for t in inputs)
        return unpack(leaves, self.input_spec), leaves

    def _run(self, value: Any, target: torch.Tensor | None) -> tuple[Any, torch.Tensor | None]:
        """The stage's module on ``value`` (and the loss on the last stage), as a unit runs."""
        with autocast(self.precision, self.device), self._labels(target):
            output = self.module(value)
            loss = self.loss_fn(output, target) if self.is_last and target is not None else None
        return output, loss

    def trial(self, inputs: Any, target: torch.Tensor | None = None) -> Callable[[], Any]:
        """A forward of a unit's shapes that keeps nothing (what a swapper names tensors
        with): on copies of ``inputs``, returning what autograd would start the backward from."""

        def run() -> Any:
            copies = inputs if self.is_first else tuple(t.detach().clone() for t in inputs)
            output, loss = self._run(self._input_value(copies)[0], target)
            return loss if self.is_last else output

        return run

    def forward(self, unit: int, inputs: Any, target: torch.Tensor | None = None) -> Packed | None:
        """Run the stage on a unit; returns the packed activations to send (None on the last)."""
        value, leaves = self._input_value(inputs)
        output, loss = self._run(value, target)
        if self.is_last:
            assert loss is not None
            share = self.shares.of_unit(unit) if self.shares is not None else None
            if loss.device.type != "meta":  # a rehearsal's shapes (pipeline.stage_rehearsal)
                self.losses[unit] = 0.0 if share is not None and not share.items else loss.item()
            scaled = loss / self.micro_batches if share is None else share.scaled(loss, output)
            self._pending[unit] = (leaves, (scaled,))
            return None
        packed = pack(output, f"stage {self.index}")
        self._pending[unit] = (leaves, packed)
        return tuple(t.detach() for t in packed)

    def held(self, unit: int) -> Packed:
        """What the runner holds for ``unit``'s backward: its input leaves and its outputs."""
        leaves, outputs = self._pending[unit]
        return (*leaves, *outputs)

    def in_flight_inputs(self) -> dict[int, Packed]:
        """Copies of the inputs of every unit whose forward ran and backward has not."""
        return {
            unit: tuple(t.detach().clone() for t in leaves)
            for unit, (leaves, _) in self._pending.items()
        }

    def backward(self, unit: int, grads: Packed | None) -> Packed | None:
        """Backward of a unit; returns the packed input gradients to send (None on stage 0)."""
        leaves, outputs = self._pending.pop(unit)
        if self.is_last:
            torch.autograd.backward(outputs[0])
        else:
            assert grads is not None and self.output_spec is not None
            chosen = [outputs[i] for i in self.output_spec.grad_indices]
            pairs = [(o, g) for o, g in zip(chosen, grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if self.is_first:
            return None
        assert self.input_spec is not None
        received: list[torch.Tensor] = []
        for i in self.input_spec.grad_indices:
            grad = leaves[i].grad
            received.append(grad if grad is not None else torch.zeros_like(leaves[i]))
        return tuple(received)

    def evaluate(
        self, inputs: Any, target: torch.Tensor | None = None
    ) -> Packed | tuple[float, int]:
        """Forward in eval mode without gradients; the last stage returns (loss, correct
        predictions)."""
        value = inputs if self.is_first else unpack(inputs, self.input_spec)  # type: ignore[arg-type]
        with evaluating(self.module), autocast(self.precision, self.device), self._labels(target):
            output = self.module(value)
            loss_tensor = (
                self.loss_fn(output, target) if self.is_last and target is not None else None
            )
        if not self.is_last:
            return pack(output, f"stage {self.index}")
        assert loss_tensor is not None
        loss = loss_tensor.item()
        correct = int((output.argmax(-1) == target).sum().item())
        return loss, correct
