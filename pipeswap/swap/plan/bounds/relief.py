"""Recomputation in the bounds: the bytes it can free in a given time, and the minimum over it.

docs/concepts.md, "Why the swap bounds are valid", says why ("With recomputation").
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from pipeswap.swap.plan.workload import Workload

__all__ = ["Relief", "min_max", "recompute_limit_s"]


class Relief:
    """``relief_T(k, i)``: at most the forward bytes recomputation can free among layers
    k..i when a GPU recomputes at most ``seconds`` per micro-batch (docs/concepts.md, "With recomputation")."""

    def __init__(self, workload: Workload, seconds: float) -> None:
        n = workload.num_layers
        freed = [max(0, b) for b in workload.freed_bytes]
        self.prefix = [0] * (n + 1)  # freed bytes of layers < i
        for i, b in enumerate(freed):
            self.prefix[i + 1] = self.prefix[i] + b
        # Fractional knapsack of layers <= i: best bytes per second first.
        self.seconds = seconds
        self.through = [0.0] * n
        # Marginal bytes per second of the knapsack of layers <= i at ``seconds`` (the rate
        # of the layer it takes in part; 0 when every layer fits): relief with s <= seconds
        # is at most through[i] - rate[i] * (seconds - s), the knapsack being concave.
        self.rate = [0.0] * n
        if seconds > 0:
            items: list[tuple[float, int]] = []  # (-bytes per second, layer)
            for i in range(n):
                if freed[i] > 0:
                    rate = (
                        freed[i] / workload.forward_s[i]
                        if workload.forward_s[i] > 0
                        else float("inf")
                    )
                    bisect.insort(items, (-rate, i))
                left, total = seconds, 0.0
                for _, k in items:
                    cost = workload.forward_s[k]
                    if cost <= left:
                        total += freed[k]
                        left -= cost
                    else:
                        total += freed[k] * left / cost
                        self.rate[i] = freed[k] / cost
                        break
                self.through[i] = total

    def between(self, k: int, i: int) -> float:
        """Freed bytes of layers k..i that recomputation can account for."""
        return min(self.through[i], self.prefix[i + 1] - self.prefix[k])

    def slope(self, k: int, i: int) -> float:
        """A supergradient of ``between(k, i)`` in the seconds: with s <= ``seconds``
        recompute seconds, at most ``between(k, i) - slope(k, i) * (seconds - s)``."""
        return self.rate[i] if self.through[i] < self.prefix[i + 1] - self.prefix[k] else 0.0


def recompute_limit_s(workload: Workload) -> float:
    """Recompute seconds beyond which no more forward memory can be freed (a hair above
    the sum, so that at it every layer fits the knapsack whole, whatever the rounding)."""
    total = sum(f for f, b in zip(workload.forward_s, workload.freed_bytes) if b > 0)
    return total * (1 + 1e-9) + 1e-12 if total > 0 else 0.0


def min_max(
    decreasing: Callable[[float], float],
    increasing: Callable[[float], float],
    limit: float,
    steps: int = 40,
) -> tuple[float, float]:
    """A lower bound of min over T >= 0 of max(decreasing(T), increasing(T)), and the T at
    which it was found (docs/concepts.md, "With recomputation")."""
    if limit <= 0 or decreasing(0.0) <= increasing(0.0):
        return max(decreasing(0.0), increasing(0.0)), 0.0
    at_limit = decreasing(limit)
    if at_limit > increasing(limit):
        return at_limit, limit  # beyond ``limit`` nothing more is freed
    lo, hi = 0.0, limit
    for _ in range(steps):
        mid = (lo + hi) / 2
        if decreasing(mid) > increasing(mid):
            lo = mid
        else:
            hi = mid
    # d(T) holds for every plan recomputing at most T, whether or not it is monotone: a
    # plan at most lo takes d(lo) > i(lo), one between i(lo) and d(hi), one above
    # i(hi) >= d(hi) and i(lo).
    return max(min(decreasing(lo), decreasing(hi)), increasing(lo)), hi
