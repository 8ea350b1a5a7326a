"""What each stage's device holds, read by the device's meter while the stage rehearses.

A profile of the whole model says what each layer saves, but not all a pipeline stage
holds: the copies of parameters tied across stages (and their gradients and optimizer
state), the input leaves and outputs the stage keeps for every unit in flight, what a
backward allocates when gradients accumulate over micro-batches, an optimizer step's
temporaries. Each stage here runs what its actions run, at one micro-batch, under a
:class:`~pipeswap.profiling.meter.DeviceMeter` (the live storages: on the CPU, or on the
meta device, where plans for CUDA are made): two forwards, their two backwards (the
second accumulating), and an update. :class:`StageReading` is what it read, the figures
a stage's plan counts (pipeswap.swap.plan.stage_costs.StageCosts).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch

from pipeswap.dist.group import single_threaded
from pipeswap.pipeline.job import build_full_model, build_meta_model
from pipeswap.pipeline.shared import find_shared, stage_module
from pipeswap.pipeline.stage import (
    BoundarySpec,
    StageRunner,
    inspect_layers,
    layer_infos,
    pack,
)
from pipeswap.profiling.meta_attention import meta_attention_like_cpu
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.partition import stage_bounds
from pipeswap.train_config import TrainConfig

__all__ = ["StageReading", "rehearse_stages"]


@dataclass(frozen=True)
class StageReading:
    """What the meter read while one stage ran two units and an update (bytes).

    ``weight_bytes``: its parameters (its copies of tied ones included); ``gradient_bytes``
    and ``state_bytes``: their gradients and the optimizer's state; ``unit_bytes``: what a
    unit holds from its forward to its backward (its input, saved tensors, outputs);
    ``forward_bytes``, ``backward_bytes`` and ``update_bytes``: what a forward, a
    backward (its received gradient and the gradient it sends included) and an update
    hold beyond that while they run; ``message_bytes``: a received input and a received
    gradient, which a rank posts ahead of the pass that takes them, and the gradients of
    its tied parameters it sends and receives (one per holder); ``batch_bytes``: the
    mini-batch (inputs and targets) its data source holds, on the stages that read it.
    """

    weight_bytes: int
    gradient_bytes: int
    state_bytes: int
    unit_bytes: int
    forward_bytes: int
    backward_bytes: int
    update_bytes: int
    message_bytes: int
    batch_bytes: int = 0

    @property
    def resident_bytes(self) -> int:
        """Held throughout: weights, gradients, optimizer state, messages, the batch."""
        return (
            self.weight_bytes
            + self.gradient_bytes
            + self.state_bytes
            + self.message_bytes
            + self.batch_bytes
        )


def rehearse_stages(config: TrainConfig) -> tuple[StageReading, ...]:
    """Every stage's :class:`StageReading` of a resolved pipeline run: on the CPU where it
    runs there (in its precision), elsewhere on the meta device (sizes in float32)."""
    pipeline = config.require_pipeline()
    cpu = config.device == "cpu"
    device = torch.device("cpu" if cpu else "meta")
    model = build_full_model(config, device) if cpu else build_meta_model(config)
    model.train()
    shared = find_shared(model, pipeline.stage_balance)
    x, y = model.example_batch(
        config.micro_batch_size,
        seq_len=config.seq_len,
        image_size=config.image_size,
        device=device,
    )
    # What crosses each cut: on the meta device in float32, touching no GPU.
    infos = inspect_layers(config) if cpu else layer_infos(model, x, config.model)
    readings = []
    value: Any = x
    n = pipeline.num_stages
    precision = config.precision if cpu else "fp32"  # the meta device does not autocast
    nesterov = weight_mode(pipeline.weights).nesterov
    threads = single_threaded() if cpu else nullcontext()
    with threads, meta_attention_like_cpu(), torch.random.fork_rng(devices=[]):
        for k, (first, end) in enumerate(stage_bounds(pipeline.stage_balance)):
            module, copies = stage_module(model, first, end, shared)
            runner = StageRunner(
                k,
                n,
                module,
                model.loss,
                micro_batches=pipeline.micro_batch_count,
                input_spec=infos[first - 1].output if k > 0 else None,
                output_spec=infos[end - 1].output if k < n - 1 else None,
                precision=precision,
                device=device,
            )
            inputs = pack(value, f"stage {k}'s input")
            reading = _rehearse(runner, inputs, y, config.optim.build, nesterov)
            tied = sum(len(s.holders) * _nbytes(copies[s.name]) for s in shared if s.name in copies)
            batch = pipeline.micro_batch_count * (_nbytes(x) + _nbytes(y))
            readings.append(
                replace(
                    reading,
                    message_bytes=reading.message_bytes + tied,
                    batch_bytes=batch if k in (0, n - 1) else 0,
                )
            )
            with torch.no_grad():
                value = module(value)
    return tuple(readings)


def _rehearse(
    runner: StageRunner,
    inputs: tuple[torch.Tensor, ...],
    target: torch.Tensor,
    build: Callable[..., torch.optim.Optimizer],
    nesterov: bool,
) -> StageReading:
    module = runner.module
    params = [p for p in module.parameters() if p.requires_grad]
    # Every holder of a tied parameter steps its copy with an optimizer of its own: the
    # same state as one optimizer over all.
    optimizer = build(params, nesterov=nesterov)
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    meter = DeviceMeter(runner.device, holding=(module,))
    gradients = sum(_nbytes(p) for p in params)
    unit = forward = backward = 0
    outputs: dict[int, tuple[torch.Tensor, ...]] = {}
    with meter:
        weights = meter.current
        for u in (0, 1):
            before = meter.current
            # As a wire delivers it (a clone: a view of the caller's tensor would count
            # the caller's storage).
            received = tuple(t.clone(memory_format=torch.contiguous_format) for t in inputs)
            label = target.clone() if runner.is_last else None
            meter.reset_peak()
            out = runner.forward(u, received[0] if runner.is_first else received, label)
            del received, label
            outputs[u] = out or ()
            del out
            unit = max(unit, meter.current - before)
            forward = max(forward, meter.peak - meter.current)
        for u in (0, 1):
            before = meter.current
            meter.reset_peak()
            grads = _gradients(outputs.pop(u), runner.output_spec)  # a received gradient
            sent = runner.backward(u, grads)
            del grads, sent
            # The first backward makes the gradients, which a plan counts as resident.
            backward = max(backward, meter.peak - before - (gradients if u == 0 else 0))
        before = meter.current
        meter.reset_peak()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = max(0, meter.current - weights)
        update = max(0, meter.peak - before - state)
    for p, grad in zip(params, saved_grads):
        p.grad = grad
    messages = sum(
        spec.nbytes for spec in (runner.input_spec, runner.output_spec) if spec is not None
    )
    return StageReading(
        weight_bytes=weights,
        gradient_bytes=gradients,
        state_bytes=state,
        unit_bytes=unit,
        forward_bytes=max(0, forward),
        backward_bytes=max(0, backward),
        update_bytes=update,
        message_bytes=messages,
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gradients(
    outputs: tuple[torch.Tensor, ...], spec: BoundarySpec | None
) -> tuple[torch.Tensor, ...] | None:
    """The gradients the next stage sends back for ``outputs`` (None on the last stage)."""
    if spec is None:
        return None
    return tuple(torch.ones_like(outputs[i]) for i in spec.grad_indices)
