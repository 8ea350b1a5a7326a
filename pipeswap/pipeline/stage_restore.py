"""A stage picks up its checkpoint: weights, in-flight forwards, messages across the cut.

What it reads is what :meth:`StageExecutor.save` wrote (pipeswap.pipeline.snapshot).
"""

from __future__ import annotations

from typing import Any

import torch

from pipeswap.checkpoint import set_rng_state
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.rng import TRAIN
from pipeswap.schedule.actions import ActionKind

__all__ = ["restore_stage"]


@torch.no_grad()
def restore_stage(stage: StageExecutor, state: dict[str, Any]) -> int:
    """Continue from a checkpoint of this stage; returns the index of the next action.

    Re-runs each in-flight forward with the weights and inputs it had (rebuilding the
    graph its backward needs) and sends again the messages that crossed the cut.
    """
    stage.weights.load_state(state["weights"])
    stage.runner.losses = dict(state["losses"])
    stage.result.evals = [tuple(e) for e in state.get("evals", [])]
    live = [p.detach().clone() for p in stage.weights.params]
    for unit in sorted(state["in_flight"]):
        used, leaves = state["in_flight"][unit]
        for p, saved in zip(stage.weights.params, used, strict=True):
            p.data.copy_(saved)
        data: tuple[Any, Any] = (None, None)
        if stage.train_data is not None:
            x, y = stage.train_data.micro(*divmod(unit, stage.micro_batches))
            data = (stage.to_device(x), stage.to_device(y))
        inputs = leaves if stage.rank > 0 else data[0]
        with torch.enable_grad(), stage.stream(TRAIN, *divmod(unit, stage.micro_batches)):
            stage.runner.forward(unit, inputs, data[1] if stage.runner.is_last else None)
        stage.cuts.forward_weights[unit] = used
    for p, saved in zip(stage.weights.params, live, strict=True):
        p.data.copy_(saved)
    for (direction, unit), message in sorted(state["sent"].items()):
        stage.transport.send(ActionKind(direction), unit, message)
    if stage.tied is not None:
        stage.tied.load_state(state.get("tied", {}), state["done"])
    set_rng_state(state["rng"])
    stage.index = state["index"]
    stage.cuts.keep_crossing(state["done"])
    return stage.index
