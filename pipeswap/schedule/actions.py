"""What a pipeline stage does, one action at a time: ActionKind, and Action with its compact form."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from pipeswap.errors import PipeswapError

__all__ = ["ACTION_KINDS", "COMPUTE_KINDS", "Action", "ActionKind"]


class ActionKind(StrEnum):
    """What an action does; each kind is its own compact string (``ActionKind.F == "F"``).

    A pass (F, B) has a *direction*: the way its data travels, activations to stage
    k + 1 after a forward, gradients to stage k - 1 after a backward. Each transfer kind
    carries the data of one direction (``ActionKind.SEND_B.direction is ActionKind.B``).
    """

    F = "F"  # forward of one unit (micro-batch) on a stage
    B = "B"  # backward of one unit
    SEND_F = "SEND_F"  # the activations of a unit, from stage k to k + 1
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # the gradient of a unit, from stage k + 1 to k
    RECV_B = "RECV_B"
    UPDATE = "UPDATE"  # apply the accumulated gradient of one mini-batch (index: the step)

    @property
    def is_pass(self) -> bool:
        """A forward or a backward."""
        return self in (ActionKind.F, ActionKind.B)

    @property
    def is_compute(self) -> bool:
        """A pass or an update: what takes the stage's compute time."""
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_receive(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)

    @property
    def direction(self) -> ActionKind:
        """The pass whose data a pass or transfer moves: F (activations) or B (gradients)."""
        found = _DIRECTION.get(self)
        if found is None:
            raise PipeswapError(f"{self} moves no data between stages")
        return found

    @property
    def step(self) -> int:
        """Where the data of this direction goes: +1 (F, to the next stage) or -1 (B)."""
        return 1 if self.direction is ActionKind.F else -1

    @property
    def send(self) -> ActionKind:
        """The send of this direction's data (``ActionKind.F.send is ActionKind.SEND_F``)."""
        return ActionKind.SEND_F if self.direction is ActionKind.F else ActionKind.SEND_B

    @property
    def receive(self) -> ActionKind:
        """The receive of this direction's data."""
        return ActionKind.RECV_F if self.direction is ActionKind.F else ActionKind.RECV_B

    def peer(self, stage: int) -> int:
        """The stage a transfer of ``stage`` goes to (a send) or comes from (a receive)."""
        return stage - self.step if self.is_receive else stage + self.step


_DIRECTION = {
    ActionKind.F: ActionKind.F,
    ActionKind.SEND_F: ActionKind.F,
    ActionKind.RECV_F: ActionKind.F,
    ActionKind.B: ActionKind.B,
    ActionKind.SEND_B: ActionKind.B,
    ActionKind.RECV_B: ActionKind.B,
}
ACTION_KINDS = tuple(kind.value for kind in ActionKind)
COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.UPDATE)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UPDATE|F|B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One thing a stage does: ``Action(2, ActionKind.F, 5)`` (or ``"F"``) is written ``2F5``.

    ``unit`` is the global micro-batch index (step * micro_batches + m) for F, B and the
    transfers, and the mini-batch (step) index for UPDATE.
    """

    stage: int
    kind: ActionKind
    unit: int

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise PipeswapError(
                f"unknown action kind {self.kind!r}; valid: {', '.join(ACTION_KINDS)}"
            )
        # A plain string ("F") is accepted and stored as its kind.
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.stage < 0 or self.unit < 0:
            raise PipeswapError(f"action {self.stage}{self.kind}{self.unit}: negative index")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.unit}"

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise PipeswapError(
                f"cannot read action {text!r}: write <stage><kind><index>, e.g. 2F5, 1B3, "
                f"0SEND_F4, 1RECV_B2, 3UPDATE0"
            )
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))
