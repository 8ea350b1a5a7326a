"""The forward and backward recursions: the shortest micro-batch a path to host allows.

docs/concepts.md, "Why the swap bounds are valid", derives them ("Turn bound").
"""

from __future__ import annotations

from pipeswap.swap.plan.bounds.inputs import MicroBatch
from pipeswap.swap.plan.bounds.relief import Relief
from pipeswap.swap.plan.workload import Workload

__all__ = ["backward_starts", "forward_ends", "micro_batch_s", "shortest_microbatch_s"]


def forward_ends(
    micro: MicroBatch, bytes_per_s: float, floor: tuple[int, float] | None = None
) -> list[float]:
    """Earliest end of every forward of a micro-batch starting at 0 (the forward
    recursion); ``floor = (i, t)`` adds ``T_i >= t``."""
    workload = micro.workload
    ends: list[float] = []
    start = 0.0
    for i in range(workload.num_layers):
        for k in range(i):
            excess = micro.excess(k, i)
            if excess > 0:
                start = max(start, ends[k] + excess / bytes_per_s)
        if floor is not None and floor[0] == i:
            start = max(start, floor[1])
        ends.append(start + workload.forward_s[i])
        start = ends[-1]
    return ends


def backward_starts(
    micro: MicroBatch, bytes_per_s: float, forward_end: list[float] | None = None
) -> list[float]:
    """Earliest start of every backward, counted from the turn (the backward recursion).

    With ``forward_end`` (the forward recursion's ends), backward j also waits for the
    swap-outs that must have ended before it starts: the starts are then counted from
    ``forward_end[-1]``, valid only added to it (not to a later turn)."""
    workload = micro.workload
    n = workload.num_layers
    starts = [0.0] * n
    if forward_end is not None:
        starts[n - 1] = _swapped_out_by(micro, bytes_per_s, forward_end, n - 1)
    for k in reversed(range(n - 1)):
        at = starts[k + 1] + workload.backward_s[k + 1]
        for j in range(k + 1, n):
            excess = micro.backward_excess(k, j)
            if excess > 0:
                # need_B[j] stays off the GPU until backward j ends (it holds its memory).
                ends = starts[j] + workload.backward_s[j]
                at = max(at, ends + excess / bytes_per_s)
        if forward_end is not None:
            at = max(at, _swapped_out_by(micro, bytes_per_s, forward_end, k))
        starts[k] = at
    return starts


def _swapped_out_by(
    micro: MicroBatch, bytes_per_s: float, forward_end: list[float], j: int
) -> float:
    """The earliest backward j can start, counted from the turn, for the need_B[j] bytes of
    layers before j to have left: those of layers k..j-1 only after forward k ended."""
    at = 0.0
    for k in range(j):
        excess = micro.backward_excess(k, j)
        if excess > 0:
            at = max(at, forward_end[k] + excess / bytes_per_s - forward_end[-1])
    return at


def micro_batch_s(micro: MicroBatch, bytes_per_s: float) -> float:
    """The shortest ``micro`` can run on a path of ``bytes_per_s`` per direction."""
    ends = forward_ends(micro, bytes_per_s)
    starts = backward_starts(micro, bytes_per_s, ends)
    return ends[-1] + starts[0] + micro.workload.backward_s[0]


def shortest_microbatch_s(
    workload: Workload, budget_bytes: int, bytes_per_s: float, relief: Relief | None = None
) -> float:
    """The shortest micro-batch any plan without recomputation (or, with ``relief``, any
    plan recomputing at most its seconds, less those seconds) can achieve on a path of
    ``bytes_per_s`` per direction: the forward and backward recursions."""
    return micro_batch_s(MicroBatch(workload, budget_bytes, relief), bytes_per_s)
