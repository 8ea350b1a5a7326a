"""pipeswap/swap/plan/tensors.py: one saved tensor, in index form and in name form."""

from __future__ import annotations

from pipeswap.swap.plan import SwapDecision
from pipeswap.swap.plan.tensors import SavedTensorAt, SwapDecisionAt

NAMES = ["embed", "h.0", "h.1", "head"]


def test_a_swap_converts_to_its_decision_and_back() -> None:
    position = {name: i for i, name in enumerate(NAMES)}
    for swap in (
        SwapDecisionAt(1, 0, 64, 1, 3),
        SwapDecisionAt(0, 2, 8, 2, len(NAMES)),
        SwapDecisionAt.latest(SavedTensorAt(2, 1, 4)),
    ):
        decision = swap.decision(NAMES)
        assert SwapDecisionAt.of_decision(decision, position) == swap
    at_turn = SwapDecisionAt(0, 2, 8, 2, len(NAMES)).decision(NAMES)
    assert at_turn == SwapDecision("embed", 2, 8, "h.1", None)


def test_the_latest_swap_leaves_after_its_layer_and_comes_back_after_the_next() -> None:
    swap = SwapDecisionAt.latest(SavedTensorAt(layer=1, index=3, bytes=100))
    assert (swap.out, swap.prefetch) == (1, 2)
    assert swap.tensor == SavedTensorAt(1, 3, 100) == (1, 3, 100)
