"""Schedule checks: every pass once, F before B, matched transfers, no deadlock."""

from __future__ import annotations

from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.timetable import Schedule, ScheduleError, listing, unit_time_order

__all__ = ["ScheduleError", "validate"]

# Where each (kind, unit) action stands in one stage's list.
_Where = dict[tuple[ActionKind, int], int]
# The order in which missing or unexpected actions of a stage are looked for.
_REPORT_ORDER = (
    ActionKind.F,
    ActionKind.B,
    ActionKind.UPDATE,
    ActionKind.SEND_F,
    ActionKind.RECV_F,
    ActionKind.SEND_B,
    ActionKind.RECV_B,
)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could not run correctly."""
    _check_structure(schedule)
    unit_time_order(schedule)


def _fail(schedule: Schedule, stage: int, index: int, message: str) -> ScheduleError:
    return ScheduleError(
        f"{schedule.name}: stage {stage}: {message}\n" + listing(schedule, {stage: index}),
        stage=stage,
        index=index,
    )


def _check_structure(schedule: Schedule) -> None:
    n = schedule.num_stages
    if len(schedule.actions) != n:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {n} stages")
    units = set(range(schedule.num_units))
    steps = set(range(schedule.num_steps))
    for stage, acts in enumerate(schedule.actions):
        where: _Where = {}
        for i, act in enumerate(acts):
            if act.stage != stage:
                raise _fail(schedule, stage, i, f"{act} belongs to stage {act.stage}")
            key = (act.kind, act.unit)
            if key in where:
                raise _fail(schedule, stage, i, f"{act} appears twice")
            where[key] = i
        expected = {ActionKind.F: units, ActionKind.B: units, ActionKind.UPDATE: steps}
        for direction in (ActionKind.F, ActionKind.B):
            # A stage receives a direction's data unless it is first, sends it unless last.
            if 0 <= stage - direction.step < n:
                expected[direction.receive] = units
            if 0 <= stage + direction.step < n:
                expected[direction.send] = units
        for kind in _REPORT_ORDER:
            have = {u for (k, u) in where if k is kind}
            want = expected.get(kind, set())
            if have != want:
                extra, missing = sorted(have - want), sorted(want - have)
                detail = f"unexpected {kind} {extra}" if extra else f"missing {kind} {missing}"
                idx = where[(kind, extra[0])] if extra else len(acts) - 1
                raise _fail(schedule, stage, idx, detail)
        _check_order(schedule, stage, where)
    for kind_send in (ActionKind.SEND_F, ActionKind.SEND_B):
        kind_recv = kind_send.receive
        for src in range(n):
            dst = kind_send.peer(src)
            if not 0 <= dst < n:
                continue
            sends = [a.unit for a in schedule.actions[src] if a.kind is kind_send]
            recvs = [a.unit for a in schedule.actions[dst] if a.kind is kind_recv]
            if sends != recvs:
                i = next(j for j, (s, r) in enumerate(zip(sends, recvs)) if s != r)
                idx = schedule.actions[dst].index(Action(dst, kind_recv, recvs[i]))
                raise _fail(
                    schedule,
                    dst,
                    idx,
                    f"receives from stage {src} in the order {recvs[: i + 1]}... but stage {src} "
                    f"sends {sends[: i + 1]}...; transfers between two stages must match in order",
                )


def _check_order(schedule: Schedule, stage: int, where: _Where) -> None:
    n = schedule.num_stages
    lag = schedule.kind.forward_lag
    F, B, UPDATE = ActionKind.F, ActionKind.B, ActionKind.UPDATE  # noqa: N806 - the kinds
    for unit in range(schedule.num_units):
        f, b = where[(F, unit)], where[(B, unit)]
        if b < f:
            raise _fail(schedule, stage, b, f"backward of unit {unit} before its forward")
        pairs = []
        if stage > 0:
            pairs += [
                ((ActionKind.RECV_F, unit), (F, unit)),
                ((B, unit), (ActionKind.SEND_B, unit)),
            ]
        if stage < n - 1:
            pairs += [
                ((F, unit), (ActionKind.SEND_F, unit)),
                ((ActionKind.RECV_B, unit), (B, unit)),
            ]
        step = schedule.step_of(unit)
        pairs.append(((B, unit), (UPDATE, step)))
        if step > 0:
            # One gradient buffer per stage: a mini-batch's backwards wait for the
            # previous mini-batch's update, or its gradient would be applied with it.
            pairs.append(((UPDATE, step - 1), (B, unit)))
        if lag is not None and step > lag:
            # A forward sees weights at most ``lag`` updates older than its own update's
            # (0: synchronous, a flush per mini-batch; 1: 2bw's double buffering).
            pairs.append(((UPDATE, step - 1 - lag), (F, unit)))
        for first, then in pairs:
            if where[first] > where[then]:
                raise _fail(
                    schedule,
                    stage,
                    where[then],
                    f"{stage}{then[0]}{then[1]} comes before {stage}{first[0]}{first[1]}",
                )
