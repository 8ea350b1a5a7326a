"""Pipeline schedules as data: per-rank ordered actions with a compact string form."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format

SCHEDULE_FORMAT = "pipeswap.schedule/1"
SCHEDULE_NAMES = ("gpipe", "1f1b", "async-1f1b", "2bw")
SYNCHRONOUS_SCHEDULES = ("gpipe", "1f1b")
# Updates a 2bw forward runs ahead of its own mini-batch's: 1 is PipeDream-2BW, 0 a flush.
TWO_BW_DELAYS = (0, 1)


class ActionKind(StrEnum):
    """What an action does; each kind is its own compact string (``ActionKind.F == "F"``)."""

    F = "F"  # forward of one unit (micro-batch) on a stage
    B = "B"  # backward of one unit
    SEND_F = "SEND_F"  # the activations of a unit, from stage k to k + 1
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # the gradient of a unit, from stage k + 1 to k
    RECV_B = "RECV_B"
    UPDATE = "UPDATE"  # apply the accumulated gradient of one mini-batch (index: the step)


ACTION_KINDS = tuple(kind.value for kind in ActionKind)
COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.UPDATE)
_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UPDATE|F|B)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One thing a rank does: ``Action(2, ActionKind.F, 5)`` (or ``"F"``) is written ``2F5``.

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
        return self.kind in COMPUTE_KINDS

    @classmethod
    def parse(cls, text: str) -> Action:
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise PipeswapError(
                f"cannot read action {text!r}: write <stage><kind><index>, e.g. 2F5, 1B3, "
                f"0SEND_F4, 1RECV_B2, 3UPDATE0"
            )
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """The ordered actions of every rank (rank k runs stage k) for ``num_steps`` mini-batches.

    Synchronous schedules (gpipe, 1f1b) split each mini-batch into ``micro_batches`` units
    and flush before one UPDATE per mini-batch; async-1f1b pipelines whole mini-batches
    (``micro_batches == 1``) and updates after every backward.
    """

    name: str
    num_stages: int
    num_steps: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]

    @property
    def synchronous(self) -> bool:
        return self.name in SYNCHRONOUS_SCHEDULES

    @property
    def num_units(self) -> int:
        return self.num_steps * self.micro_batches

    def step_of(self, unit: int) -> int:
        """The mini-batch (step) a unit belongs to."""
        return unit // self.micro_batches

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def to_string(self) -> str:
        """One line per rank: ``0: 0F0 0SEND_F0 0F1 ...``."""
        return "\n".join(
            f"{rank}: " + " ".join(str(a) for a in acts) for rank, acts in enumerate(self.actions)
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


def build_schedule(
    name: str, num_stages: int, num_steps: int, micro_batches: int = 1, *, delay: int = 1
) -> Schedule:
    """The named schedule for ``num_stages`` ranks and ``num_steps`` mini-batches.

    ``delay`` applies to ``2bw`` only (see :func:`two_bw_orders`): 1 is PipeDream-2BW,
    0 makes every forward wait for the previous mini-batch's update (synchronous
    gradient accumulation, the same updates as ``1f1b``).
    """
    if name not in SCHEDULE_NAMES:
        raise PipeswapError(f"unknown schedule {name!r}; valid: {', '.join(SCHEDULE_NAMES)}")
    if num_stages < 1 or num_steps < 1 or micro_batches < 1:
        raise PipeswapError(
            f"{name}: stages ({num_stages}), steps ({num_steps}) and micro-batches "
            f"({micro_batches}) must all be at least 1"
        )
    if name == "async-1f1b" and micro_batches != 1:
        raise PipeswapError(
            "async-1f1b pipelines whole mini-batches and updates after every backward, so it "
            f"takes no micro-batches (got {micro_batches}); drop --micro-batches or use "
            "--schedule 1f1b"
        )
    if name == "2bw":
        orders = two_bw_orders(num_stages, num_steps, micro_batches, delay=delay)
    else:
        builder = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order, "async-1f1b": _async_order}
        orders = [
            builder[name](stage, num_stages, num_steps, micro_batches)
            for stage in range(num_stages)
        ]
    rows = tuple(_with_transfers(order, num_stages) for order in orders)
    return Schedule(name, num_stages, num_steps, micro_batches, rows)


def _gpipe_order(stage: int, n: int, steps: int, m: int) -> list[Action]:
    order: list[Action] = []
    for step in range(steps):
        units = range(step * m, (step + 1) * m)
        order += [Action(stage, ActionKind.F, u) for u in units]
        order += [Action(stage, ActionKind.B, u) for u in units]
        order.append(Action(stage, ActionKind.UPDATE, step))
    return order


def _one_f_one_b_order(stage: int, n: int, steps: int, m: int) -> list[Action]:
    order: list[Action] = []
    warmup = min(n - stage - 1, m)
    for step in range(steps):
        base = step * m
        forwards = [Action(stage, ActionKind.F, base + i) for i in range(m)]
        backwards = [Action(stage, ActionKind.B, base + i) for i in range(m)]
        order += forwards[:warmup]
        for i in range(m - warmup):
            order += [forwards[warmup + i], backwards[i]]
        order += backwards[m - warmup :]
        order.append(Action(stage, ActionKind.UPDATE, step))
    return order


def _async_order(stage: int, n: int, steps: int, m: int) -> list[Action]:
    # PipeDream's 1F1B without flush: stage k admits n - k mini-batches, then each
    # backward (and its update) frees room for the next forward.
    in_flight = min(n - stage, steps)
    order = [Action(stage, ActionKind.F, u) for u in range(in_flight)]
    for unit in range(steps):
        order += [Action(stage, ActionKind.B, unit), Action(stage, ActionKind.UPDATE, unit)]
        if unit + in_flight < steps:
            order.append(Action(stage, ActionKind.F, unit + in_flight))
    return order


def two_bw_orders(
    n: int,
    steps: int,
    m: int,
    *,
    delay: int = 1,
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
) -> list[list[Action]]:
    """PipeDream-2BW's compute order per stage: 1F1B over micro-batches with no flush.

    Rules every stage keeps (t is a mini-batch, ``delay`` 1):

    - the forwards of t run after this stage's UPDATE(t - 2) and before its UPDATE(t - 1),
      so each sees the weights one update older than those UPDATE(t) applies its gradient
      to (W(t+1) = W(t) - lr * grad(W(t-1))); under ``stash`` its backward reuses them;
    - the backwards of t run after UPDATE(t - 1): the stage keeps one gradient buffer, so a
      mini-batch's gradient starts accumulating once the previous one is applied;
    - UPDATE(t) follows the last backward of t (and the last forward of t + 1).

    Within those rules the order is found by running the pipeline on an idealized machine
    (forward ``forward_cost``, backward ``backward_cost``, free transfers): a stage starts
    whatever may run earliest, an UPDATE before a backward before a forward. So warm-up
    (stage k runs the forwards of mini-batches 0 and 1 while the first gradients travel)
    and cool-down (the last mini-batch drains) follow from the same rules as the steady
    state. ``delay=0`` makes the forwards of t wait for UPDATE(t - 1): a flush per
    mini-batch, the updates of synchronous gradient accumulation.

    Memory: a stage holds at most 2m micro-batches' activations (t + 1's forwards run
    while t's backwards drain); capping that at 1F1B's m + N - k - 1 costs throughput.
    """
    if delay not in TWO_BW_DELAYS:
        raise PipeswapError(f"2bw: delay must be one of {TWO_BW_DELAYS}, not {delay}")
    units = steps * m
    inf = float("inf")
    orders: list[list[Action]] = [[] for _ in range(n)]
    clock = [0.0] * n
    next_f, next_b, updates = [0] * n, [0] * n, [0] * n
    # When unit u's activation (gradient) reaches stage k: set by the sender's pass.
    act_at: list[dict[int, float]] = [dict() for _ in range(n)]
    grad_at: list[dict[int, float]] = [dict() for _ in range(n)]

    def candidates(k: int) -> list[tuple[float, int, str]]:
        out: list[tuple[float, int, str]] = []
        t = updates[k]  # the next UPDATE of stage k
        if t < steps and next_b[k] >= (t + 1) * m and next_f[k] >= min(t + 1 + delay, steps) * m:
            out.append((clock[k], 0, "UPDATE"))
        u = next_b[k]
        if u < next_f[k] and u // m <= updates[k] and u in grad_at[k]:
            out.append((max(clock[k], grad_at[k][u]), 1, "B"))
        u = next_f[k]
        if u < units and u // m <= updates[k] + delay and (k == 0 or u in act_at[k]):
            out.append((max(clock[k], act_at[k].get(u, 0.0)), 2, "F"))
        return out

    while any(updates[k] < steps for k in range(n)):
        best = min(
            ((start, rank, k, kind) for k in range(n) for start, rank, kind in candidates(k)),
            default=(inf, 0, -1, ""),
        )
        start, _, k, kind = best
        if k < 0:  # pragma: no cover - the rules above always leave a runnable action
            raise PipeswapError(f"2bw: no runnable action for {n} stages, {m} micro-batches")
        if kind == "UPDATE":
            orders[k].append(Action(k, ActionKind.UPDATE, updates[k]))
            updates[k] += 1
        elif kind == "B":
            u = next_b[k]
            clock[k] = start + backward_cost
            orders[k].append(Action(k, ActionKind.B, u))
            next_b[k] += 1
            if k > 0:
                grad_at[k - 1][u] = clock[k]
        else:
            u = next_f[k]
            clock[k] = start + forward_cost
            orders[k].append(Action(k, ActionKind.F, u))
            next_f[k] += 1
            if k < n - 1:
                act_at[k + 1][u] = clock[k]
            else:
                grad_at[k][u] = clock[k]
    return orders


def _with_transfers(order: list[Action], n: int) -> tuple[Action, ...]:
    """Wrap each compute action in the receives it needs and the sends it produces."""
    out: list[Action] = []
    for act in order:
        k = act.stage
        if act.kind == "F":
            if k > 0:
                out.append(Action(k, ActionKind.RECV_F, act.unit))
            out.append(act)
            if k < n - 1:
                out.append(Action(k, ActionKind.SEND_F, act.unit))
        elif act.kind == "B":
            if k < n - 1:
                out.append(Action(k, ActionKind.RECV_B, act.unit))
            out.append(act)
            if k > 0:
                out.append(Action(k, ActionKind.SEND_B, act.unit))
        else:
            out.append(act)
    return tuple(out)
