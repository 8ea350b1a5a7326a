"""Recomputation finer than a block: per layer keep it, recompute it selectively, or
recompute it whole, for the least recomputation time that fits the budget.

Whole-block recomputation frees a layer's saved bytes for its whole forward again.
Selective recomputation (pipeswap.swap.runtime.selective) frees the bytes of its cheap
operations for a fraction of that time, keeping the outputs of its matmuls and attention.
Starting from every layer recomputed whole (the least memory a plan without swaps
holds), :func:`plan_finer` gives time back by the cheapest move per byte while the plan
still fits: a layer recomputed whole becomes selective, a selective one is kept. With
``selective=False`` the only move is back from whole to kept: the same search with
whole blocks, the baseline finer choices are measured against.
"""

from __future__ import annotations

from collections.abc import Callable

from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.scoring import Assignment
from pipeswap.swap.plan.workload import Workload

__all__ = ["plan_finer", "view"]

WHOLE, SELECTIVE, KEPT = "whole", "selective", "kept"


def plan_finer(case: Case, *, selective: bool = True) -> Assignment | None:
    """The recompute-only plan of least recomputation time that fits (nothing swapped),
    each layer kept, recomputed selectively (where the profile measured it and
    ``selective``) or recomputed whole; None when recomputing every layer whole does
    not fit either."""
    workload = case.workload
    n = workload.num_layers
    state = {i: WHOLE if i in workload.recomputable else KEPT for i in range(n)}
    if not _fits(workload, state, case.budget_bytes):
        return None
    moves = _moves(workload, selective and workload.can_select)
    while True:
        ranked = sorted(
            (
                (_priority(gain, cost), layer, after)
                for layer, before in state.items()
                for (start, after), (gain, cost) in moves(layer).items()
                if start == before and gain > 0
            ),
            reverse=True,
        )
        for _, layer, after in ranked:
            trial = {**state, layer: after}
            if _fits(workload, trial, case.budget_bytes):
                state = trial
                break
        else:
            break
    recompute = frozenset(i for i, mode in state.items() if mode != KEPT)
    chosen = frozenset(i for i, mode in state.items() if mode == SELECTIVE)
    return Assignment(
        {gpu: () for gpu in case.gpus},
        recompute={gpu: recompute for gpu in case.gpus},
        selective=chosen,
    )


def view(workload: Workload, state: dict[int, str]) -> Workload:
    """``workload`` with each layer as ``state`` says."""
    selective = [i for i, mode in state.items() if mode == SELECTIVE]
    return workload.selecting(selective).recomputing([i for i, m in state.items() if m != KEPT])


def _fits(workload: Workload, state: dict[int, str], budget_bytes: int) -> bool:
    return view(workload, state).fits((), budget_bytes)


def _priority(gain_s: float, cost_bytes: int) -> float:
    """Seconds given back per byte it costs (a move that costs nothing first)."""
    return float("inf") if cost_bytes <= 0 else gain_s / cost_bytes


def _moves(
    workload: Workload, selective: bool
) -> Callable[[int], dict[tuple[str, str], tuple[float, int]]]:
    """Per layer, the moves that give time back: (from, to) -> (seconds, bytes)."""
    saved = workload.all_saved_bytes
    whole_kept = workload.recomputing(()).kept_bytes  # its input

    def layer_moves(i: int) -> dict[tuple[str, str], tuple[float, int]]:
        found = {(WHOLE, KEPT): (workload.forward_s[i], saved[i] - whole_kept[i])}
        if selective and workload.selective_kept[i] < saved[i]:
            kept = workload.selective_kept[i]
            found[(WHOLE, SELECTIVE)] = (
                workload.forward_s[i] - workload.selective_s[i],
                kept - whole_kept[i],
            )
            found[(SELECTIVE, KEPT)] = (workload.selective_s[i], saved[i] - kept)
        return found

    return layer_moves
