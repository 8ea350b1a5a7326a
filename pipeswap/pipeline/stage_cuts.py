"""What a stage keeps for its checkpoints: the weights of its in-flight forwards, and copies
of the messages it sent that cross the next cut (pipeswap.pipeline.snapshot)."""

from __future__ import annotations

import torch

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.pipeline.snapshot import crossing_messages, positions
from pipeswap.pipeline.stage import Packed
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule

__all__ = ["Message", "StageCuts"]

Message = tuple[ActionKind, int]


class StageCuts:
    """Stage ``stage``'s bookkeeping for the checkpoints of ``plan`` (None: it keeps nothing).

    ``forward_weights``: the weights each in-flight forward used (a resume re-runs it with
    them). ``kept``: copies of the sends since the last checkpoint that cross the next cut,
    keyed ("F", unit) with plain strings, as a checkpoint holds plain data only.
    ``crossing``: the sends of the latest checkpoint's cut that arrive after it.
    """

    def __init__(
        self, plan: CheckpointPlan | None, schedule: Schedule, stage: int, steps: int
    ) -> None:
        self.plan = plan
        self.schedule = schedule
        self.stage = stage
        self.steps = steps
        self.forward_weights: dict[int, list[torch.Tensor]] = {}
        self.kept: dict[tuple[str, int], Packed] = {}
        self.crossing: set[Message] = set()
        self._keep: set[Message] = set()
        self._cut_keep: set[Message] | None = None
        self._positions = positions(schedule) if plan is not None else None
        self.keep_crossing(0)

    def forward(self, unit: int, params: list[torch.nn.Parameter]) -> None:
        """Before ``unit``'s forward: the weights it uses, when checkpoints are written."""
        if self.plan is not None:
            self.forward_weights[unit] = [p.detach().clone() for p in params]

    def sent(self, direction: ActionKind, unit: int, message: Packed) -> None:
        """A copy of ``message`` when it crosses a cut to come."""
        if (direction, unit) in self._keep:
            self.kept[(direction.value, unit)] = tuple(t.detach().clone() for t in message)

    def keep_crossing(self, done: int) -> None:
        """Keep copies of the sends crossing the next checkpoint's cut, after ``done`` steps."""
        plan = self.plan
        if plan is None or plan.every <= 0:
            return
        upcoming = (done // plan.every + 1) * plan.every
        if plan.due(upcoming, self.steps):
            self._keep = crossing_messages(self.schedule, upcoming, self._positions)[self.stage]

    def keep_for_cut(self, cut: int) -> None:
        """Keep copies of the sends crossing the cut after ``cut`` steps too (a SIGTERM's)."""
        if self._cut_keep is None:
            self._cut_keep = crossing_messages(self.schedule, cut, self._positions)[self.stage]
        self._keep |= self._cut_keep

    def saved(self, done: int) -> None:
        """A checkpoint after ``done`` steps holds ``kept``: start keeping for the next one."""
        self.crossing = {(ActionKind(d), unit) for d, unit in self.kept}
        self.kept = {}
        self.keep_crossing(done)
