"""A stage picks up its checkpoint: weights, in-flight forwards, messages across the cut.

What it reads is what :meth:`StageExecutor.save` wrote (pipeswap.pipeline.snapshot).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeswap.checkpoint import set_rng_state
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.rng import TRAIN
from pipeswap.schedule.actions import ActionKind

__all__ = ["restore_stage"]


@torch.no_grad()
def restore_stage(executor: StageExecutor, state: dict[str, Any]) -> int:
    """Continue from a checkpoint of this stage; returns the index of the next action.

    Re-runs each in-flight forward with the weights and inputs it had (rebuilding the
    graph its backward needs), puts the buffers back as saved, and sends again the
    messages that crossed the cut.
    """
    _check_shapes(executor.weights.params, state["weights"]["params"])
    executor.weights.load_state(state["weights"])
    executor.runner.losses = dict(state["losses"])
    executor.result.evals = [tuple(e) for e in state.get("evals", [])]
    live = [p.detach().clone() for p in executor.weights.params]
    for unit in sorted(state["in_flight"]):
        used, leaves = state["in_flight"][unit]
        for p, saved in zip(executor.weights.params, used, strict=True):
            p.data.copy_(saved)
        data: tuple[Any, Any] = (None, None)
        if executor.train_data is not None:
            x, y = executor.train_data.micro(*divmod(unit, executor.micro_batches))
            data = (executor.to_device(x), executor.to_device(y))
        inputs = leaves if executor.stage > 0 else data[0]
        with torch.enable_grad(), executor.stream(TRAIN, *divmod(unit, executor.micro_batches)):
            executor.runner.forward(unit, inputs, data[1] if executor.runner.is_last else None)
        executor.cuts.forward_weights[unit] = used
    for p, saved in zip(executor.weights.params, live, strict=True):
        p.data.copy_(saved)
    # The buffers as saved (BatchNorm's statistics): after the forwards run again, which
    # counted their batches a second time; through .data, as the forwards' graphs hold
    # them (BatchNorm's backward reads its statistics) and BatchNorm updates them so too.
    buffers = dict(executor.module.named_buffers())
    for name, saved in state.get("buffers", {}).items():
        if name in buffers:
            buffers[name].data.copy_(saved)
    for (direction, unit), message in sorted(state["sent"].items()):
        executor.transport.send(ActionKind(direction), unit, message)
    if executor.tied is not None:
        executor.tied.load_state(state.get("tied", {}), state["done"])
    set_rng_state(state["rng"])
    executor.index = state["index"]
    executor.cuts.keep_crossing(state["done"])
    return executor.index


def _check_shapes(params: list[torch.nn.Parameter], saved: list[torch.Tensor]) -> None:
    """Refuse a checkpoint of another model (another width, other layers) by name of shape."""
    shapes = [tuple(p.shape) for p in params]
    found = [tuple(t.shape) for t in saved]
    if shapes != found:
        first = next(
            (i for i, (a, b) in enumerate(zip(shapes, found)) if a != b),
            min(len(shapes), len(found)),
        )
        mine = shapes[first] if first < len(shapes) else "none"
        theirs = found[first] if first < len(found) else "none"
        raise PipeswapError(
            f"the checkpoint holds other weights than this stage's model: {len(found)} "
            f"parameters where it has {len(shapes)}, and parameter {first} of shape {theirs} "
            f"where it has {mine}; load a checkpoint saved by the same model and balance"
        )
