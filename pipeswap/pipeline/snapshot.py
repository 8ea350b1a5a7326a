"""Where a pipeline can be checkpointed: each stage's cut after an UPDATE, and what crosses it.

A checkpoint after ``done`` optimizer steps cuts every stage's action list right after its
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

import json
import signal
from pathlib import Path

from pipeswap.checkpoint import StopOnSigterm
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import write_atomic
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.timetable import Schedule

__all__ = ["Positions", "StageAtCut", "StopRequest", "crossing_messages", "cut_index", "positions"]

_SENDS = (ActionKind.SEND_F, ActionKind.SEND_B)

Positions = dict[tuple[int, ActionKind, int], int]


def positions(schedule: Schedule) -> Positions:
    """Where each (stage, kind, unit) action stands in its stage's list (computed once per run)."""
    return {
        (r, a.kind, a.unit): i
        for r, acts in enumerate(schedule.actions)
        for i, a in enumerate(acts)
    }


def cut_index(schedule: Schedule, stage: int, done: int) -> int:
    """Position of stage's ``UPDATE(done - 1)``: its last action before a checkpoint."""
    return schedule.actions[stage].index(Action(stage, ActionKind.UPDATE, done - 1))


def crossing_messages(
    schedule: Schedule, done: int, where: Positions | None = None
) -> dict[int, set[tuple[ActionKind, int]]]:
    """Per stage, the (direction, unit) messages it sends before the cut that arrive after.

    Only units within N + 1 steps of the cut can cross it: no stage runs further ahead
    or behind, so the search looks at those alone (``where`` from :func:`positions`).
    """
    where = positions(schedule) if where is None else where
    n, micro = schedule.num_stages, schedule.micro_batches
    cuts = [where[(r, ActionKind.UPDATE, done - 1)] for r in range(n)]
    window = range(max(0, (done - n - 1) * micro), min(schedule.num_units, (done + n + 1) * micro))
    keep: dict[int, set[tuple[ActionKind, int]]] = {r: set() for r in range(n)}
    for stage, kind, unit in (
        (r, k, u) for r in range(n) for k in _SENDS for u in window if (r, k, u) in where
    ):
        i = where[(stage, kind, unit)]
        peer = kind.peer(stage)
        j = where[(peer, kind.receive, unit)]
        sent, received = i <= cuts[stage], j <= cuts[peer]
        if received and not sent:
            raise PipeswapError(
                f"{schedule.name} cannot be checkpointed after step {done}: stage "
                f"{peer} receives unit {unit} before its cut but stage {stage} sends it "
                "after; checkpoint at another step"
            )
        if sent and not received:
            keep[stage].add((kind.direction, unit))
    return keep


class StageAtCut(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a stage that checkpointed at the SIGTERM cut and runs no further action."""


class StopRequest:
    """SIGTERM (or Ctrl-C) to a pipeline becomes a checkpoint at a step every stage agrees on
    (Ctrl-C twice stops at once).

    Stage 0 decides: at its first UPDATE after the signal, step ``t``, it picks the cut
    after ``t + N + 2`` steps. No stage is more than N - 1 updates ahead of stage 0 (its
    forwards need stage 0's), so every stage learns the step at least one update before
    its cut, in time to keep the messages that will cross it. In one process (the
    emulator) the stages share this object; across processes stage 0 also writes the
    step to ``stop-request.json`` in the checkpoint folder, which the others read at each
    UPDATE once checkpoints are on.
    """

    def __init__(self, directory: str, num_stages: int, steps: int, *, decider: bool) -> None:
        self.num_stages = num_stages
        self.steps = steps
        self.target: int | None = None
        self._file = Path(directory) / "stop-request.json"
        if decider:  # a request left by an earlier run must not stop this one
            self._file.unlink(missing_ok=True)
        self._signal = StopOnSigterm((signal.SIGTERM, signal.SIGINT))

    @property
    def signal_name(self) -> str:
        """The signal that asked for the stop (stage 0's; the others were sent SIGTERM)."""
        return self._signal.caught or "SIGTERM"

    def cut_after(self, worker: int, done: int) -> int | None:
        """After this stage's ``done``-th update: the steps after which all stages stop."""
        if self.target is None:
            if worker == 0 and self._signal.requested:
                target = done + self.num_stages + 2
                if target >= self.steps:  # the run ends first: let it finish
                    self._signal.requested = False
                    return None
                self.target = target
                write_atomic(self._file, json.dumps({"step": target}))
            elif worker != 0 and self._file.exists():
                self.target = int(json.loads(self._file.read_text())["step"])
        return self.target

    def close(self) -> None:
        self._signal.restore()
