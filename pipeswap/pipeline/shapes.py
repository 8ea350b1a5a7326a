"""What crosses each cut of a pipeline for a batch of a given shape, found without compute.

A pipeline's receive buffers are allocated before the data arrives, so a stage must know
the shape of what it receives. A loop that pads each batch to its own longest sequence (or
ends on a short batch) changes those shapes from step to step; every stage sees the same
batches (pipeswap.Pipeline's contract), so each can trace the model on the new shape
itself. Tracing runs on fake tensors (torch's FakeTensorMode: shapes and dtypes, no data,
no FLOPs), and for real, without gradients, where a model does something fake tensors
cannot (a data-dependent shape).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pipeswap.models.base import evaluating
from pipeswap.pipeline.stage import BoundarySpec, TensorSpec, pack
from pipeswap.precision import autocast
from pipeswap.schedule.actions import ActionKind

__all__ = ["BatchShapes", "boundary_specs"]


def boundary_specs(model: nn.Module, sample: torch.Tensor, precision: str) -> list[BoundarySpec]:
    """What each layer of ``model`` (its children in order) hands on for ``sample`` (one
    micro-batch), under the run's autocast on each layer's own device."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            return _traced(model, mode.from_tensor(sample), precision)
    except Exception:  # what fake tensors cannot run, a real forward without gradients can
        return _traced(model, sample, precision)


def _traced(model: nn.Module, value: Any, precision: str) -> list[BoundarySpec]:
    specs = []
    with torch.no_grad(), evaluating(model):
        for name, layer in model.named_children():
            device = next((p.device for p in layer.parameters()), None)
            if device is not None:  # the stages of a pipeline live on different devices
                value = _moved(value, device)
            with autocast(precision, device or torch.device("cpu")):
                value = layer(value)
            tensors = pack(value, f"layer {name!r}")
            shapes = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
            specs.append(BoundarySpec(isinstance(value, tuple), shapes))
    return specs


def _moved(value: Any, device: torch.device) -> Any:
    if isinstance(value, tuple):
        return tuple(v.to(device) for v in value)
    return value.to(device)


class BatchShapes:
    """What stage ``stage`` (layers ``first`` to ``end``) of ``stages`` receives for each
    shape of batch it is handed: the first batch's are the transport's own specs; a batch
    of another shape has its transfers expected as traced (once per shape)."""

    def __init__(
        self,
        model: nn.Module,
        bounds: tuple[int, int],
        stage: int,
        stages: int,
        micro_batches: int,
        precision: str,
        first: torch.Tensor,
    ) -> None:
        self.model, self.bounds, self.stage, self.stages = model, bounds, stage, stages
        self.micro_batches, self.precision = micro_batches, precision
        self.first = _key(first)
        self.traced: dict[tuple[Any, ...], tuple[BoundarySpec | None, BoundarySpec | None]] = {}

    def expect(self, transport: Any, inputs: torch.Tensor, first_unit: int) -> None:
        """Tell ``transport`` (a DistTransport) the shapes of the ``micro_batches`` units
        from ``first_unit`` on, a batch of ``inputs``."""
        key = _key(inputs)
        if key == self.first:
            return
        if key not in self.traced:
            sample = inputs[: len(inputs) // self.micro_batches]
            specs = boundary_specs(self.model, sample, self.precision)
            first, end = self.bounds
            received = specs[first - 1] if self.stage > 0 else None
            returned = specs[end - 1] if self.stage < self.stages - 1 else None
            self.traced[key] = (received, returned)
        received, returned = self.traced[key]
        for unit in range(first_unit, first_unit + self.micro_batches):
            if received is not None:
                transport.expect(ActionKind.F, unit, received)
            if returned is not None:
                transport.expect(ActionKind.B, unit, returned)


def _key(inputs: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(inputs.shape), inputs.dtype)
