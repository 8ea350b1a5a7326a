"""SwapPlan: JSON round trip and validation against the profile it was made for."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.runtime.checks import check_plan_identity


def _plan(swaps: tuple[SwapDecision, ...]) -> SwapPlan:
    return SwapPlan(
        policy="disjoint",
        model="toy",
        layers=("l0", "l1", "l2"),
        gpus=(GpuPlan("gpu0", 0, 10**9, 0.5, swaps),),
        sync_every=2,
        predicted_iteration_s=3.0,
        lower_bound_s=2.5,
        notes={"k": 1},
    )


def test_round_trip_is_exact(make_profile, tmp_path) -> None:
    plan = _plan(
        (SwapDecision("l0", 1, 2 * 10**9, "l0", "l2"), SwapDecision("l1", 0, 10**9, "l1", None))
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    again = SwapPlan.load(path)
    assert again == plan
    assert again.to_json()["format"] == "pipeswap.swapplan/2"
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
    with pytest.raises(PipeswapError, match="pipeswap.swapplan/2"):
        SwapPlan.from_json({"format": "pipeswap.graph/1"})


def test_plan_records_its_profile_and_old_files_still_load(make_profile) -> None:
    profile = make_profile([(1, 2), (1,), (1,)])
    plan = dataclasses.replace(_plan(()), batch=profile.batch, dtype="float32", seq_len=None)
    again = SwapPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert (again.batch, again.dtype, again.seq_len, again.image_size) == (1, "float32", None, None)
    old = plan.to_json()
    for key in ("batch", "dtype", "seq_len", "image_size", "turn_bound_s"):
        del old[key]
    legacy = SwapPlan.from_json(old)
    assert legacy.batch is None and legacy.dtype is None
    legacy.validate(dataclasses.replace(profile, batch=64))  # nothing recorded, nothing refused


def test_a_plan_for_another_profile_is_refused_even_when_it_swaps_nothing(make_profile) -> None:
    profile = make_profile([(1, 2), (1,), (1,)])
    plan = dataclasses.replace(_plan(()), batch=1, dtype="float32", seq_len=64)
    with pytest.raises(PipeswapError, match=r"another profile \(seq_len 64 \(plan\) vs None"):
        plan.validate(profile)
    model = nn.Sequential()
    for name in plan.layers:
        model.add_module(name, nn.Linear(2, 2))
    bigger = dataclasses.replace(profile, batch=8, seq_len=64)
    with pytest.raises(PipeswapError, match=r"batch 1 \(plan\) vs 8 \(profile\)"):
        check_plan_identity(plan, model, list(plan.layers), bigger)
    check_plan_identity(plan, model, list(plan.layers), dataclasses.replace(profile, seq_len=64))
    half = model.to(torch.float16)
    with pytest.raises(
        PipeswapError, match="float32 profile but the model's parameters are float16"
    ):
        check_plan_identity(plan, half, list(plan.layers), None)


def test_recompute_round_trips_and_version_1_plans_still_load(make_profile) -> None:
    plan = dataclasses.replace(
        _plan((SwapDecision("l0", 0, 10**9, "l0", None),)),
        gpus=(
            GpuPlan("gpu0", 0, 10**9, 0.0, (SwapDecision("l0", 0, 10**9, "l0", None),), ("l1",)),
        ),
    )
    obj = plan.to_json()
    assert obj["gpus"][0]["recompute"] == ["l1"]
    assert SwapPlan.from_json(json.loads(json.dumps(obj))) == plan
    plan.validate(make_profile([(1, 2), (1,), (1,)]))
    old = {**obj, "format": "pipeswap.swapplan/1", "gpus": [{**obj["gpus"][0]}]}
    del old["gpus"][0]["recompute"]
    assert SwapPlan.from_json(old).gpus[0].recompute == ()


@pytest.mark.parametrize(
    ("recompute", "message"),
    [
        (("l7",), "the profile does not have"),
        (("l1", "l1"), "listed twice"),
        (("l0",), "drop the swap"),
    ],
)
def test_bad_recompute_is_refused(make_profile, recompute, message) -> None:
    gpu = GpuPlan("gpu0", 0, 10**9, 0.0, (SwapDecision("l0", 0, 10**9, "l0", None),), recompute)
    with pytest.raises(PipeswapError, match=message):
        dataclasses.replace(_plan(()), gpus=(gpu,)).validate(make_profile([(1, 2), (1,), (1,)]))
