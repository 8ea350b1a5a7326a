"""SwapPlan: JSON round trip and validation against the profile it was made for."""

from __future__ import annotations

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan


def _plan(swaps: tuple[SwapDecision, ...]) -> SwapPlan:
    return SwapPlan(
        policy="disjoint", model="toy", layers=("l0", "l1", "l2"),
        gpus=(GpuPlan("gpu0", 0, 10**9, 0.5, swaps),), sync_every=2,
        predicted_iteration_s=3.0, lower_bound_s=2.5, notes={"k": 1},
    )


def test_round_trip_is_exact(make_profile, tmp_path) -> None:
    plan = _plan((SwapDecision("l0", 1, 2 * 10**9, "l0", "l2"), SwapDecision("l1", 0, 10**9, "l1", None)))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = SwapPlan.load(path)
    assert again == plan
    assert again.to_json()["format"] == "pipeswap.swapplan/1"
    assert again.gpus[0].swapped_bytes == 3 * 10**9
    again.validate(make_profile([(1, 2), (1,), (1,)]))


@pytest.mark.parametrize(
    ("swap", "message"),
    [
        (SwapDecision("l9", 0, 10**9, "l9", None), "not in the profile"),
        (SwapDecision("l0", 5, 10**9, "l0", None), "saves indices [0, 1]"),
        (SwapDecision("l0", 0, 7, "l0", None), "bytes in the plan"),
        (SwapDecision("l1", 0, 10**9, "l0", None), "not the owner"),
        (SwapDecision("l1", 0, 10**9, "l1", "l1"), "not a later layer"),
    ],
)
def test_validation_names_the_problem(make_profile, swap, message) -> None:
    with pytest.raises(PipeswapError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _plan((swap,)).validate(make_profile([(1, 2), (1,), (1,)]))


def test_tensor_swapped_twice_is_refused(make_profile) -> None:
    twice = (SwapDecision("l0", 0, 10**9, "l0", None), SwapDecision("l0", 0, 10**9, "l1", None))
    with pytest.raises(PipeswapError, match="swapped twice"):
        _plan(twice).validate(make_profile([(1, 2), (1,), (1,)]))


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.swapplan/1"):
        SwapPlan.from_json({"format": "pipeswap.graph/1"})
