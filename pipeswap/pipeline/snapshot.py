"""Where a pipeline can be checkpointed: each stage's cut after an UPDATE, and what crosses it.

A checkpoint after ``done`` optimizer steps cuts every rank's action list right after its
``UPDATE(done - 1)``. Stages are at different points of the schedule there: stage k still
has forwards in flight (async-1f1b keeps up to N - k - 1), and an activation sent before the
sender's cut may be received after the receiver's. So a stage's checkpoint holds, besides
its weights and optimizer: the weights and inputs of each in-flight forward (resuming
re-runs those forwards to rebuild their graphs, bit for bit) and every message it sent
that its neighbour receives after its own cut (resuming sends them again). A message
received before the receiver's cut is always sent before the sender's: the cut is
consistent, which :func:`crossing_messages` checks.
"""

from __future__ import annotations

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.schedule import Action, ActionKind, Schedule

_SENDS = {ActionKind.SEND_F: ("F", 1, ActionKind.RECV_F), ActionKind.SEND_B: ("B", -1, ActionKind.RECV_B)}


def cut_index(schedule: Schedule, rank: int, done: int) -> int:
    """Position of rank's ``UPDATE(done - 1)``: its last action before a checkpoint."""
    return schedule.actions[rank].index(Action(rank, ActionKind.UPDATE, done - 1))


def crossing_messages(schedule: Schedule, done: int) -> dict[int, set[tuple[str, int]]]:
    """Per rank, the (direction, unit) messages it sends before the cut that arrive after."""
    cuts = [cut_index(schedule, r, done) for r in range(schedule.num_stages)]
    position = {
        (r, a.kind, a.unit): i for r, acts in enumerate(schedule.actions) for i, a in enumerate(acts)
    }
    keep: dict[int, set[tuple[str, int]]] = {r: set() for r in range(schedule.num_stages)}
    for (rank, kind, unit), i in position.items():
        if kind not in _SENDS:
            continue
        direction, step, receive = _SENDS[kind]
        j = position[(rank + step, receive, unit)]
        sent, received = i <= cuts[rank], j <= cuts[rank + step]
        if received and not sent:
            raise PipeswapError(
                f"{schedule.name} cannot be checkpointed after step {done}: stage "
                f"{rank + step} receives unit {unit} before its cut but stage {rank} sends it "
                "after; checkpoint at another step"
            )
        if sent and not received:
            keep[rank].add((direction, unit))
    return keep
