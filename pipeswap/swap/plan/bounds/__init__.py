"""Lower bounds of a swap plan's iteration time, by term family.

``link`` is design.md's link bound; ``turn`` the turn bound, whose shared-link terms are
in ``sharing``; ``recursion`` the per-GPU forward and backward recursions; ``relief``
what recomputation can free; ``inputs`` the parameter object they all read. Why every
term holds for every plan is in docs/concepts.md, "Why the swap bounds are valid".
"""

from pipeswap.swap.plan.bounds.link import LowerBound, lower_bound
from pipeswap.swap.plan.bounds.recursion import shortest_microbatch_s
from pipeswap.swap.plan.bounds.relief import Relief, recompute_limit_s
from pipeswap.swap.plan.bounds.turn import TurnBound, turn_bound

__all__ = [
    "LowerBound",
    "Relief",
    "TurnBound",
    "lower_bound",
    "recompute_limit_s",
    "shortest_microbatch_s",
    "turn_bound",
]
