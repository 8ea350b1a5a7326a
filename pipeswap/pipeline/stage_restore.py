"""A stage's checkpoint, written and picked up: weights, in-flight forwards, messages across the cut."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeswap.checkpoint import CheckpointPlan, rng_state, save_rank, set_rng_state, write_manifest
from pipeswap.pipeline.actions import ActionKind
from pipeswap.pipeline.rng import TRAIN
from pipeswap.pipeline.snapshot import crossing_messages

if TYPE_CHECKING:
    from pipeswap.pipeline.executor import StageExecutor


def stage_state(stage: StageExecutor, done: int) -> dict[str, Any]:
    """What a stage's checkpoint after ``done`` steps holds (read by :func:`restore_stage`)."""
    return {
        "done": done,
        "index": stage._index,
        "weights": stage.weights.state(),
        "losses": dict(stage.runner.losses),
        "evals": list(stage.result.evals),
        "in_flight": {
            unit: (stage._forward_weights[unit], leaves)
            for unit, leaves in stage.runner.in_flight_inputs().items()
        },
        "sent": stage._kept,
        "rng": rng_state(),
        "tied": stage.tied.state(done) if stage.tied is not None else {},
        # What `pipeswap export` reads: the weights' names in the whole model.
        "names": [name for name, _ in stage.named_parameters()],
        "buffers": {n: b.detach().clone() for n, b in stage.module.named_buffers()},
    }


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
            data = (stage._to_device(x), stage._to_device(y))
        inputs = leaves if stage.rank > 0 else data[0]
        with torch.enable_grad(), stage._stream(TRAIN, *divmod(unit, stage.micro_batches)):
            stage.runner.forward(unit, inputs, data[1] if stage.runner.is_last else None)
        stage._forward_weights[unit] = used
    for p, saved in zip(stage.weights.params, live, strict=True):
        p.data.copy_(saved)
    for (direction, unit), message in sorted(state["sent"].items()):
        stage.transport.send(ActionKind(direction), unit, message)
    if stage.tied is not None:
        stage.tied.load_state(state.get("tied", {}), state["done"])
    set_rng_state(state["rng"])
    stage._index = state["index"]
    keep_crossing(stage, state["done"])
    return stage._index


def save_stage(stage: StageExecutor, plan: CheckpointPlan, done: int) -> None:
    """Write ``stage``'s state at its cut after ``done`` steps (see pipeline.snapshot)."""
    assert not stage._outbox
    if stage.slot == 0:
        write_manifest(plan, done)
    save_rank(plan, done, stage.slot, stage_state(stage, done))
    stage._last_crossing = {(ActionKind(d), unit) for d, unit in stage._kept}
    stage._kept = {}
    keep_crossing(stage, done)


def keep_crossing(stage: StageExecutor, done: int) -> None:
    """Which sends ``stage`` keeps a copy of: those crossing the next checkpoint's cut."""
    plan = stage.checkpoint
    if plan is None or plan.every <= 0:
        return
    upcoming = (done // plan.every + 1) * plan.every
    if plan.due(upcoming, stage.config.steps):
        stage._keep = crossing_messages(stage.schedule, upcoming, stage._positions)[stage.rank]
