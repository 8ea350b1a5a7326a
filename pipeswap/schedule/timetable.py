"""Pipeline schedules as data: per-stage ordered actions, their string form, their unit-time run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format
from pipeswap.schedule.actions import ACTION_KINDS, COMPUTE_KINDS, Action, ActionKind
from pipeswap.schedule.kinds import SCHEDULE_NAMES, ScheduleKind, schedule_kind

__all__ = [
    "ACTION_KINDS",
    "COMPUTE_KINDS",
    "SCHEDULE_FORMAT",
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "TimedAction",
    "build_schedule",
    "listing",
    "unit_time_order",
]

SCHEDULE_FORMAT = "pipeswap.schedule/1"


@dataclass(frozen=True)
class Schedule:
    """The ordered actions of every stage (``actions[k]``: stage k's) for ``num_steps`` mini-batches.

    Synchronous schedules (gpipe, 1f1b) split each mini-batch into ``micro_batches`` units
    and flush before one UPDATE per mini-batch; async-1f1b pipelines whole mini-batches
    (``micro_batches == 1``) and updates after every backward. ``name`` is an entry of
    :data:`pipeswap.schedule.kinds.SCHEDULES` (:attr:`kind`).
    """

    name: str
    num_stages: int
    num_steps: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def kind(self) -> ScheduleKind:
        """The table entry of this schedule's name."""
        return schedule_kind(self.name)

    @property
    def synchronous(self) -> bool:
        return not self.kind.asynchronous

    @property
    def num_units(self) -> int:
        return self.num_steps * self.micro_batches

    def step_of(self, unit: int) -> int:
        """The mini-batch (step) a unit belongs to."""
        return unit // self.micro_batches

    def compute_actions(self, stage: int) -> list[Action]:
        return [a for a in self.actions[stage] if a.is_compute]

    def to_string(self) -> str:
        """One line per stage: ``0: 0F0 0SEND_F0 0F1 ...``."""
        return "\n".join(
            f"{stage}: " + " ".join(str(a) for a in acts) for stage, acts in enumerate(self.actions)
        )

    @classmethod
    def from_string(cls, text: str, *, name: str, num_steps: int, micro_batches: int) -> Schedule:
        rows: list[tuple[Action, ...]] = []
        for line in text.strip().splitlines():
            _, _, body = line.partition(":")
            rows.append(tuple(Action.parse(tok) for tok in body.split()))
        return cls(name, len(rows), num_steps, micro_batches, tuple(rows))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SCHEDULE_FORMAT,
            "name": self.name,
            "num_stages": self.num_stages,
            "num_steps": self.num_steps,
            "micro_batches": self.micro_batches,
            "actions": [[str(a) for a in acts] for acts in self.actions],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "schedule") -> Schedule:
        check_format(obj, SCHEDULE_FORMAT, where)
        try:
            actions = tuple(tuple(Action.parse(t) for t in acts) for acts in obj["actions"])
            return cls(
                name=str(obj["name"]),
                num_stages=int(obj["num_stages"]),
                num_steps=int(obj["num_steps"]),
                micro_batches=int(obj["micro_batches"]),
                actions=actions,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PipeswapError(f"{where}: malformed schedule ({exc!r})") from None


# A forward and a backward per stage and unit, each with the receive and the send around
# it (the last stage's sends and the first's receives are absent; counted anyway).
ACTIONS_PER_PASS_PAIR = 6
MAX_ACTIONS = 5_000_000


def build_schedule(
    name: str, num_stages: int, num_steps: int, micro_batches: int = 1, *, delay: int = 1
) -> Schedule:
    """The named schedule for ``num_stages`` stages and ``num_steps`` mini-batches.

    ``delay`` applies to ``2bw`` only (see :func:`pipeswap.schedule.orders.two_bw_orders`):
    1 is PipeDream-2BW, 0 makes every forward wait for the previous mini-batch's update
    (synchronous gradient accumulation, the same updates as ``1f1b``).
    """
    kind = schedule_kind(name)
    if num_stages < 1 or num_steps < 1 or micro_batches < 1:
        raise PipeswapError(
            f"{name}: stages ({num_stages}), steps ({num_steps}) and micro-batches "
            f"({micro_batches}) must all be at least 1"
        )
    kind.check_micro_batches(micro_batches)
    _check_size(name, num_stages, num_steps, micro_batches)
    orders = kind.build(num_stages, num_steps, micro_batches, delay)
    rows = tuple(_with_transfers(order, num_stages) for order in orders)
    return Schedule(name, num_stages, num_steps, micro_batches, rows)


def _check_size(name: str, num_stages: int, num_steps: int, micro_batches: int) -> None:
    """Refuse, before building it, a schedule too large to hold: the schedule is built in
    memory before the run (about 120 bytes and 12 us to build and check per action)."""
    per_step = num_stages * micro_batches * ACTIONS_PER_PASS_PAIR + num_stages
    if num_steps * per_step <= MAX_ACTIONS:
        return
    raise ConfigError(
        f"{{steps}} {num_steps:,} on {name} with {num_stages} stages and {micro_batches} "
        f"micro-batches is {num_steps * per_step:,} scheduled actions, more than the "
        f"{MAX_ACTIONS:,} a run may build up front; use at most {MAX_ACTIONS // per_step:,} "
        "{steps} per run"
    )


def _with_transfers(order: list[Action], n: int) -> tuple[Action, ...]:
    """Wrap each pass in the receive it needs and the send it produces."""
    out: list[Action] = []
    for act in order:
        if not act.kind.is_pass:
            out.append(act)
            continue
        k, kind = act.stage, act.kind
        # A forward's data comes from stage k - 1 and goes to k + 1; a backward's the reverse.
        if 0 <= k - kind.step < n:
            out.append(Action(k, kind.receive, act.unit))
        out.append(act)
        if 0 <= k + kind.step < n:
            out.append(Action(k, kind.send, act.unit))
    return tuple(out)


class ScheduleError(PipeswapError):
    """An invalid schedule; ``stage`` and ``index`` point at the offending action."""

    def __init__(self, message: str, stage: int | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.index = index


@dataclass(frozen=True)
class TimedAction:
    """An action placed on a stage's timeline by :func:`unit_time_order` (transfers take no time)."""

    stage: int
    index: int
    action: Action
    start: float
    end: float


def unit_time_order(
    schedule: Schedule,
    *,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    update_cost: float = 0.0,
) -> list[TimedAction]:
    """Run the schedule on an idealized machine; return every action in execution order.

    Each pass takes its cost in time units, transfers none. A SEND never blocks (the
    runtime's sends are non-blocking); a RECV waits until the peer has run the matching
    SEND. The returned order is a valid global interleaving: the emulator executes actions
    in exactly this order. Raises :class:`ScheduleError` when the schedule deadlocks.
    """
    costs = {
        ActionKind.F: forward_cost,
        ActionKind.B: backward_cost,
        ActionKind.UPDATE: update_cost,
    }
    n = schedule.num_stages
    pointer = [0] * n
    clock = [0.0] * n
    # (direction, receiving stage, unit) -> when the message was sent.
    sent: dict[tuple[ActionKind, int, int], float] = {}
    order: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for stage in range(n):
            acts = schedule.actions[stage]
            while pointer[stage] < len(acts):
                act = acts[pointer[stage]]
                start = clock[stage]
                if act.kind.is_receive:
                    key = (act.kind.direction, stage, act.unit)
                    if key not in sent:
                        break
                    start = clock[stage] = max(clock[stage], sent[key])
                elif act.kind.is_send:
                    sent[(act.kind.direction, act.kind.peer(stage), act.unit)] = clock[stage]
                else:
                    clock[stage] += costs[act.kind]
                order.append(TimedAction(stage, pointer[stage], act, start, clock[stage]))
                pointer[stage] += 1
                progress = True
    if any(pointer[r] < len(schedule.actions[r]) for r in range(n)):
        stuck = [r for r in range(n) if pointer[r] < len(schedule.actions[r])]
        waits = ", ".join(f"stage {r} at {schedule.actions[r][pointer[r]]}" for r in stuck)
        raise ScheduleError(
            f"{schedule.name}: deadlock, every unfinished stage waits for a message that is "
            f"never sent ({waits})\n" + listing(schedule, {r: pointer[r] for r in stuck}),
            stage=stuck[0],
            index=pointer[stuck[0]],
        )
    return order


def listing(schedule: Schedule, marks: dict[int, int]) -> str:
    """Each stage's actions, the marked one (``marks[stage]``, an index) in brackets."""
    lines = []
    for stage, acts in enumerate(schedule.actions):
        cells = [f"[{a}]" if marks.get(stage) == i else str(a) for i, a in enumerate(acts)]
        lines.append(f"stage {stage}: " + " ".join(cells))
    return "\n".join(lines)
