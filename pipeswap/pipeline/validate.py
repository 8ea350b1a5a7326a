"""Schedule checks: every pass once, F before B, matched transfers, no deadlock."""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.schedule import Action, ActionKind, Schedule


class ScheduleError(PipeswapError):
    """An invalid schedule; ``rank`` and ``index`` point at the offending action."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.index = index


@dataclass(frozen=True)
class TimedAction:
    """An action placed on a rank's timeline by :func:`simulate` (transfers take no time)."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` could not run correctly."""
    _check_structure(schedule)
    simulate(schedule)


def simulate(
    schedule: Schedule,
    *,
    forward_cost: float = 1.0,
    backward_cost: float = 1.0,
    update_cost: float = 0.0,
) -> list[TimedAction]:
    """Run the schedule on an idealized machine; return every action in execution order.

    A SEND never blocks (the runtime uses non-blocking sends); a RECV waits until the
    peer has run the matching SEND. The returned order is a valid global interleaving:
    the emulator executes actions in exactly this order.
    """
    costs = {"F": forward_cost, "B": backward_cost, "UPDATE": update_cost}
    n = schedule.num_stages
    pointer = [0] * n
    clock = [0.0] * n
    sent: dict[tuple[str, int, int], float] = {}
    order: list[TimedAction] = []
    progress = True
    while progress:
        progress = False
        for rank in range(n):
            acts = schedule.actions[rank]
            while pointer[rank] < len(acts):
                act = acts[pointer[rank]]
                start = clock[rank]
                if act.kind.startswith("RECV"):
                    key = (act.kind[-1], rank, act.unit)
                    if key not in sent:
                        break
                    start = clock[rank] = max(clock[rank], sent[key])
                elif act.kind.startswith("SEND"):
                    dst = rank + 1 if act.kind == "SEND_F" else rank - 1
                    sent[(act.kind[-1], dst, act.unit)] = clock[rank]
                else:
                    clock[rank] += costs[act.kind]
                order.append(TimedAction(rank, pointer[rank], act, start, clock[rank]))
                pointer[rank] += 1
                progress = True
    if any(pointer[r] < len(schedule.actions[r]) for r in range(n)):
        stuck = [r for r in range(n) if pointer[r] < len(schedule.actions[r])]
        waits = ", ".join(f"rank {r} at {schedule.actions[r][pointer[r]]}" for r in stuck)
        raise ScheduleError(
            f"{schedule.name}: deadlock, every unfinished rank waits for a message that is "
            f"never sent ({waits})\n" + _listing(schedule, {r: pointer[r] for r in stuck}),
            rank=stuck[0],
            index=pointer[stuck[0]],
        )
    return order


def _listing(schedule: Schedule, marks: dict[int, int]) -> str:
    """Each rank's actions, the marked one in brackets."""
    lines = []
    for rank, acts in enumerate(schedule.actions):
        cells = [f"[{a}]" if marks.get(rank) == i else str(a) for i, a in enumerate(acts)]
        lines.append(f"rank {rank}: " + " ".join(cells))
    return "\n".join(lines)


def _fail(schedule: Schedule, rank: int, index: int, message: str) -> ScheduleError:
    return ScheduleError(
        f"{schedule.name}: rank {rank}: {message}\n" + _listing(schedule, {rank: index}),
        rank=rank,
        index=index,
    )


def _check_structure(schedule: Schedule) -> None:
    n = schedule.num_stages
    if len(schedule.actions) != n:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} ranks for {n} stages")
    units = set(range(schedule.num_units))
    steps = set(range(schedule.num_steps))
    for rank, acts in enumerate(schedule.actions):
        where: dict[tuple[str, int], int] = {}
        for i, act in enumerate(acts):
            if act.stage != rank:
                raise _fail(schedule, rank, i, f"{act} belongs to stage {act.stage}")
            key = (act.kind, act.unit)
            if key in where:
                raise _fail(schedule, rank, i, f"{act} appears twice")
            where[key] = i
        expected: dict[str, set[int]] = {"F": units, "B": units, "UPDATE": steps}
        if rank > 0:
            expected.update({"RECV_F": units, "SEND_B": units})
        if rank < n - 1:
            expected.update({"SEND_F": units, "RECV_B": units})
        for kind in ("F", "B", "UPDATE", "SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            have = {u for (k, u) in where if k == kind}
            want = expected.get(kind, set())
            if have != want:
                extra, missing = sorted(have - want), sorted(want - have)
                detail = f"unexpected {kind} {extra}" if extra else f"missing {kind} {missing}"
                idx = where[(kind, extra[0])] if extra else len(acts) - 1
                raise _fail(schedule, rank, idx, detail)
        _check_order(schedule, rank, where)
    for kind_send, kind_recv, step in (
        (ActionKind.SEND_F, ActionKind.RECV_F, 1),
        (ActionKind.SEND_B, ActionKind.RECV_B, -1),
    ):
        for src in range(n):
            dst = src + step
            if not 0 <= dst < n:
                continue
            sends = [a.unit for a in schedule.actions[src] if a.kind == kind_send]
            recvs = [a.unit for a in schedule.actions[dst] if a.kind == kind_recv]
            if sends != recvs:
                i = next(j for j, (s, r) in enumerate(zip(sends, recvs)) if s != r)
                idx = schedule.actions[dst].index(Action(dst, kind_recv, recvs[i]))
                raise _fail(
                    schedule,
                    dst,
                    idx,
                    f"receives from rank {src} in the order {recvs[: i + 1]}... but rank {src} "
                    f"sends {sends[: i + 1]}...; transfers between two ranks must match in order",
                )


def _check_order(schedule: Schedule, rank: int, where: dict[tuple[str, int], int]) -> None:
    n = schedule.num_stages
    for unit in range(schedule.num_units):
        f, b = where[("F", unit)], where[("B", unit)]
        if b < f:
            raise _fail(schedule, rank, b, f"backward of unit {unit} before its forward")
        pairs = []
        if rank > 0:
            pairs += [(("RECV_F", unit), ("F", unit)), (("B", unit), ("SEND_B", unit))]
        if rank < n - 1:
            pairs += [(("F", unit), ("SEND_F", unit)), (("RECV_B", unit), ("B", unit))]
        step = schedule.step_of(unit)
        pairs.append((("B", unit), ("UPDATE", step)))
        if step > 0:
            # One gradient buffer per stage: a mini-batch's backwards wait for the
            # previous mini-batch's update, or its gradient would be applied with it.
            pairs.append((("UPDATE", step - 1), ("B", unit)))
        if schedule.synchronous and step > 0:
            pairs.append((("UPDATE", step - 1), ("F", unit)))
        if schedule.name == "2bw" and step > 1:
            # Double buffering: a forward is at most one update older than the live weights.
            pairs.append((("UPDATE", step - 2), ("F", unit)))
        for first, then in pairs:
            if where[first] > where[then]:
                raise _fail(
                    schedule,
                    rank,
                    where[then],
                    f"{rank}{then[0]}{then[1]} comes before {rank}{first[0]}{first[1]}",
                )
