"""Checking a plan against the model and the run: refusals that name the fix, issue points.

Covers: pipeswap/swap/runtime/checks.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.runtime.checks import (
    check_budget,
    check_records,
    checked_decisions,
    checked_recompute,
    issue_points,
    rank_plan,
)

NAMES = ["a", "b", "c"]
CPU = torch.device("cpu")


def _gpu(*swaps: SwapDecision, recompute: tuple[str, ...] = (), budget: int = 10**9) -> GpuPlan:
    return GpuPlan("gpu0", 0, budget, 0.0, swaps, recompute)


def _records(sizes: dict[str, list[int]]) -> dict[str, list[CapturedSavedTensor]]:
    return {
        layer: [
            CapturedSavedTensor(layer, i, n, (n // 4,), "float32") for i, n in enumerate(nbytes)
        ]
        for layer, nbytes in sizes.items()
    }


def test_a_rank_the_plan_does_not_cover_is_refused() -> None:
    plan = SwapPlan("hand", "toy", tuple(NAMES), (_gpu(),))
    assert rank_plan(plan, 0) is plan.gpus[0]
    with pytest.raises(PipeswapError, match=r"no part for rank 3: it plans ranks \[0\]"):
        rank_plan(plan, 3)


def test_decisions_are_keyed_by_name_and_refused_when_they_cannot_run() -> None:
    a0 = SwapDecision("a", 0, 8, "a", "b")
    assert checked_decisions(_gpu(a0), NAMES) == {("a", 0): a0}
    with pytest.raises(PipeswapError, match="'bb'.*did you mean 'b'"):
        checked_decisions(_gpu(SwapDecision("bb", 0, 8, "c", None)), NAMES)
    with pytest.raises(PipeswapError, match="before its layer has run; name 'b'"):
        checked_decisions(_gpu(SwapDecision("b", 0, 8, "a", None)), NAMES)
    with pytest.raises(PipeswapError, match="swapped twice"):
        checked_decisions(_gpu(a0, a0), NAMES)


def test_recomputed_layers_must_not_nest_or_swap() -> None:
    outer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    layers = {"a": outer, "b": outer[1], "c": nn.Linear(2, 2)}
    assert checked_recompute(_gpu(recompute=("c", "b")), layers) == ["b", "c"]  # forward order
    with pytest.raises(PipeswapError, match="recomputed layer 'a' contains layer 'b'"):
        checked_recompute(_gpu(recompute=("a",)), layers)
    swapped = SwapDecision("c", 0, 8, "c", None)
    with pytest.raises(PipeswapError, match="swapped, but its layer is recomputed"):
        checked_recompute(_gpu(swapped, recompute=("c",)), layers)


def test_tensors_this_run_does_not_save_are_refused() -> None:
    records = _records({"a": [8], "b": [16], "c": []})
    check_records({("a", 0): SwapDecision("a", 0, 8, "a", None)}, records)
    with pytest.raises(PipeswapError, match=r"saves 1 tensors \(indices 0..0\)"):
        check_records({("b", 1): SwapDecision("b", 1, 16, "b", None)}, records)
    with pytest.raises(PipeswapError, match="8 bytes in the plan but 16 in this run") as info:
        check_records({("b", 0): SwapDecision("b", 0, 8, "b", None)}, records)
    # More bytes than planned may be a view of a larger tensor: the message says so.
    assert "a view of a larger tensor" in str(info.value) and "x.clone()" in str(info.value)
    with pytest.raises(PipeswapError, match="32 bytes in the plan but 16 in this run") as info:
        check_records({("b", 0): SwapDecision("b", 0, 32, "b", None)}, records)
    assert "view" not in str(info.value)


def test_copies_are_issued_at_their_points_needed_first() -> None:
    a0 = SwapDecision("a", 0, 8, "a", "c")
    a1 = SwapDecision("a", 1, 8, "b", "c")
    b0 = SwapDecision("b", 0, 8, "b", None)
    c0 = SwapDecision("c", 0, 8, "c", None)
    decisions = checked_decisions(_gpu(a0, a1, b0, c0), NAMES)
    points = issue_points(decisions, NAMES)
    assert points.outs_after == {"a": [("a", 0)], "b": [("b", 0), ("a", 1)]}
    assert points.outs_at_turn == [("c", 0)]  # after the last forward
    assert points.prefetch_after == {"c": [("a", 0), ("a", 1)]}
    assert points.prefetch_at_turn == [("c", 0), ("b", 0)]  # later layers first


def test_a_budget_the_plan_cannot_keep_names_the_setting_and_the_shortfall() -> None:
    records = _records({"a": [100], "b": [100], "c": [100]})
    decisions = {("a", 0): SwapDecision("a", 0, 100, "a", "b")}

    def needed(budget: int) -> int:
        return check_budget(
            _gpu(budget=budget),
            decisions,
            records,
            NAMES,
            resident_bytes=50,
            transient=[10, 10, 10],
            device=CPU,
        )

    # a's tensor is off the GPU from forward b until it is prefetched after backward b.
    assert needed(10**9) == 50 + 200 + 10
    assert needed(260) == 260
    # Within the slack (a run's sizes differ from the profile's by a storage) it runs; the
    # device's meter, not this check, has the last word.
    assert needed(258) == 260
    with pytest.raises(PipeswapError, match=r"needs 260 bytes, 3 bytes .* gpu_memory_bytes"):
        needed(257)


def test_a_plan_recomputing_every_layer_names_the_smallest_budget_that_works() -> None:
    records = _records({"a": [100], "b": [100], "c": [100]})

    def needed(budget: int) -> int:
        gpu = _gpu(recompute=tuple(NAMES), budget=budget)
        return check_budget(
            gpu, {}, records, NAMES, resident_bytes=50, transient=[10] * 3, device=CPU
        )

    with pytest.raises(PipeswapError, match="the smallest budget that works is") as refused:
        needed(20)  # less than the resident bytes alone
    least = int(str(refused.value).split("works is ")[1].split()[0])
    assert needed(least) == least  # that budget, given back, holds


def test_a_plan_swapping_every_saved_tensor_names_the_smallest_budget_that_works() -> None:
    records = _records({"a": [100], "b": [100], "c": [100]})
    every = {
        ("a", 0): SwapDecision("a", 0, 100, "a", "b"),
        ("b", 0): SwapDecision("b", 0, 100, "b", "c"),
    }
    with pytest.raises(PipeswapError, match="every saved tensor swapped, the smallest budget"):
        check_budget(_gpu(budget=20), every | {("c", 0): SwapDecision("c", 0, 100, "c", "c")},
                     records, NAMES, resident_bytes=50, transient=[10] * 3, device=CPU)  # fmt: skip
    with pytest.raises(PipeswapError, match="give a larger gpu_memory_bytes"):  # c's stays
        check_budget(_gpu(budget=20), every, records, NAMES, resident_bytes=50,
                     transient=[10] * 3, device=CPU)  # fmt: skip
