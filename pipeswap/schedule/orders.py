"""The compute order of every stage of each schedule: its forwards, backwards and updates.

A builder returns, per stage, the F/B/UPDATE actions in the order the stage runs them;
:func:`pipeswap.schedule.timetable.build_schedule` wraps them in their transfers. Every
builder takes ``(num_stages, steps, micro_batches, delay)``; only ``2bw`` reads ``delay``.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeswap.errors import PipeswapError
from pipeswap.schedule.actions import Action, ActionKind

__all__ = [
    "TWO_BW_DELAYS",
    "OrderBuilder",
    "async_orders",
    "gpipe_orders",
    "one_f_one_b_orders",
    "peak_in_flight",
    "two_bw_orders",
]

# (num_stages, steps, micro_batches, delay) -> per stage, its compute actions in order.
OrderBuilder = Callable[[int, int, int, int], list[list[Action]]]
# Updates a 2bw forward runs ahead of its own mini-batch's: 1 is PipeDream-2BW, 0 a flush.
TWO_BW_DELAYS = (0, 1)


def gpipe_orders(n: int, steps: int, m: int, delay: int = 1) -> list[list[Action]]:
    """GPipe: per step every forward, then every backward, then the flush and UPDATE."""
    orders = []
    for stage in range(n):
        order: list[Action] = []
        for step in range(steps):
            units = range(step * m, (step + 1) * m)
            order += [Action(stage, ActionKind.F, u) for u in units]
            order += [Action(stage, ActionKind.B, u) for u in units]
            order.append(Action(stage, ActionKind.UPDATE, step))
        orders.append(order)
    return orders


def one_f_one_b_orders(n: int, steps: int, m: int, delay: int = 1) -> list[list[Action]]:
    """1F1B with a flush per step: N - k - 1 warm-up forwards, then forward/backward pairs."""
    orders = []
    for stage in range(n):
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
        orders.append(order)
    return orders


def async_orders(n: int, steps: int, m: int = 1, delay: int = 1) -> list[list[Action]]:
    """PipeDream's 1F1B without flush: stage k admits N - k mini-batches, then each
    backward (and its update) frees room for the next forward."""
    orders = []
    for stage in range(n):
        in_flight = min(n - stage, steps)
        order = [Action(stage, ActionKind.F, u) for u in range(in_flight)]
        for unit in range(steps):
            order += [Action(stage, ActionKind.B, unit), Action(stage, ActionKind.UPDATE, unit)]
            if unit + in_flight < steps:
                order.append(Action(stage, ActionKind.F, unit + in_flight))
        orders.append(order)
    return orders


def two_bw_orders(
    n: int,
    steps: int,
    m: int,
    delay: int = 1,
    *,
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

    def candidates(k: int) -> list[tuple[float, int, ActionKind]]:
        out: list[tuple[float, int, ActionKind]] = []
        t = updates[k]  # the next UPDATE of stage k
        if t < steps and next_b[k] >= (t + 1) * m and next_f[k] >= min(t + 1 + delay, steps) * m:
            out.append((clock[k], 0, ActionKind.UPDATE))
        u = next_b[k]
        if u < next_f[k] and u // m <= updates[k] and u in grad_at[k]:
            out.append((max(clock[k], grad_at[k][u]), 1, ActionKind.B))
        u = next_f[k]
        if u < units and u // m <= updates[k] + delay and (k == 0 or u in act_at[k]):
            out.append((max(clock[k], act_at[k].get(u, 0.0)), 2, ActionKind.F))
        return out

    while any(updates[k] < steps for k in range(n)):
        best = min(
            (
                (start, priority, k, kind)
                for k in range(n)
                for start, priority, kind in candidates(k)
            ),
            default=(inf, 0, -1, ActionKind.UPDATE),
        )
        start, _, k, kind = best
        if k < 0:  # pragma: no cover - the rules above always leave a runnable action
            raise PipeswapError(f"2bw: no runnable action for {n} stages, {m} micro-batches")
        if kind is ActionKind.UPDATE:
            orders[k].append(Action(k, ActionKind.UPDATE, updates[k]))
            updates[k] += 1
        elif kind is ActionKind.B:
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


def peak_in_flight(order: list[Action]) -> int:
    """The most units whose forward ran and backward has not, over one stage's order."""
    live = peak = 0
    for action in order:
        if action.kind.is_pass:
            live += 1 if action.kind is ActionKind.F else -1
            peak = max(peak, live)
    return peak
