"""Pipelines whose stages swap: plans per policy, and runs bit-identical to the same
pipeline without swapping, each stage's saved tensors within what its budget leaves.

Covers: pipeswap/training/pipeline_stage_swaps.py, the stage swappers in
pipeswap/pipeline/executor.py (pipeswap/swap/runtime/unit_swapper.py) in the emulator and in
processes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from support import pipeline_run

from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.profiling.profile import Profile
from pipeswap.swap.plan.stage_swap import floor_bytes, stage_order
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training import pipeline_stage_swaps
from pipeswap.training.pipeline_parallel import run_pipeline
from pipeswap.training.pipeline_stage_swaps import (
    micro_profile,
    placed_gpu,
    plan_stage_swaps,
    recompute_allowed,
    recompute_bytes,
)


def _pipeline(stages: int = 4, micro_batches: int = 8, **fields: Any) -> TrainConfig:
    """gpt2-tiny (6 layers) cut into ``stages``, 16 samples a step in ``micro_batches``."""
    balance = {2: (3, 3), 4: (2, 1, 1, 2)}[stages]
    given = {"seq_len": 32, "steps": 3, "lr": 0.05, "device": "cpu", **fields}
    config = pipeline_run("gpt2-tiny", balance, batch=16, micro_batches=micro_batches, **given)
    return resolve_pipeline(replace(config, progress=False).resolved())


def _swapping(config: TrainConfig, policy: str, **budget: Any) -> TrainConfig:
    return replace(config, swap=SwapConfig(policy=policy, **budget))


@cache
def _profile(micro: int) -> Profile:
    return micro_profile(_pipeline(micro_batches=16 // micro))


def _plans(config: TrainConfig, policy: str, **budget: Any) -> Any:
    micro = config.micro_batch_size
    return plan_stage_swaps(_swapping(config, policy, **budget), _profile(micro))


def test_each_policy_plans_only_its_moves() -> None:
    config = _pipeline()
    disjoint = _plans(config, "disjoint", footprint_ratio=1.25)
    assert any(p.swapped for p in disjoint.plans)
    assert not any(p.recomputed for p in disjoint.plans)
    recompute = _plans(config, "recompute", footprint_ratio=1.3)
    assert any(p.recomputed for p in recompute.plans)
    assert not any(p.swapped for p in recompute.plans)
    everything = _plans(config, "save-on-cpu")
    assert [sorted(p.swapped) for p in everything.plans] == [[0, 1], [2], [3], [4, 5]]
    assert plan_stage_swaps(_swapping(config, "none")) is None
    assert plan_stage_swaps(config) is None  # no swap settings: the stages keep everything
    # Every plan fits: its modelled peak is within the budget on every stage.
    schedule = pipeline_schedule(config)
    for plans in (disjoint, recompute):
        assert max(plans.planned_peak_bytes(schedule)) <= plans.budget_bytes


def test_each_rank_takes_the_gpu_its_stage_was_planned_for() -> None:
    plans = _plans(_pipeline(), "disjoint", footprint_ratio=1.25)
    assert plans.gpus == ("gpu0", "gpu1", "gpu2", "gpu3")  # switch-4, the CPU's preset
    placed = [placed_gpu(plans, rank, 4, 4) for rank in range(4)]
    assert sorted(placed) == [0, 1, 2, 3]  # type: ignore[type-var]
    assert [plans.gpus[i] for i in placed] == list(plans.placement[0])  # type: ignore[index]
    assert placed_gpu(plans, 0, 4, 2) is None  # ranks that share GPUs keep local ranks
    assert placed_gpu(plans, 0, 4, 8) is None  # another machine than the topology's


def test_on_cuda_stages_plan_on_the_meta_device_without_touching_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("planning for CUDA must not run the model on a device")

    measured = _plans(_pipeline(), "hybrid", footprint_ratio=1.3)
    monkeypatch.setattr(pipeline_stage_swaps, "measure", no_measuring)
    monkeypatch.setattr(pipeline_stage_swaps, "build_full_model", no_measuring)
    config = replace(_pipeline(), device="cuda")  # resolved on this CPU: planning only
    estimated = plan_stage_swaps(_swapping(config, "hybrid", footprint_ratio=1.3))
    # The meta device saves what the CPU does: the same bytes, so the same budget.
    assert [c.saved for c in estimated.costs] == [c.saved for c in measured.costs]
    assert [c.rerun for c in estimated.costs] == [c.rerun for c in measured.costs]
    assert estimated.budget_bytes == measured.budget_bytes
    assert any(not p.empty for p in estimated.plans)
    # Under bf16-mixed too (the meta device does not autocast: float32 sizes, no error).
    mixed = _swapping(replace(config, precision="bf16-mixed"), "recompute", footprint_ratio=1.3)
    assert plan_stage_swaps(mixed) is not None


def test_a_budget_no_plan_fits_names_the_smallest_that_does() -> None:
    config = _pipeline()
    with pytest.raises(ConfigError, match="smallest budget that works is") as caught:
        _plans(config, "disjoint", gpu_memory_bytes=1)
    smallest = int(str(caught.value).split("works is ")[1].split(" bytes")[0])
    plans = _plans(config, "disjoint", gpu_memory_bytes=smallest)
    costs = plans.costs
    orders = [stage_order(pipeline_schedule(config), k) for k in range(len(costs))]
    assert smallest == max(floor_bytes(o, c, recompute=False) for o, c in zip(orders, costs))
    # Two stages of 1F1B: stage 0 holds two units, one computing, one still copying.
    two = _pipeline(2, micro_batches=4)
    with pytest.raises(ConfigError, match="no plan lowers the peak here"):
        plan_stage_swaps(_swapping(two, "disjoint", footprint_ratio=1.2), _profile(4))
    with pytest.raises(ConfigError, match="mip plans data-parallel swaps"):
        _plans(config, "mip")


def test_recomputing_the_last_layer_keeps_what_the_loss_after_it_saves() -> None:
    kept, rerun = recompute_bytes(_pipeline())
    assert len(kept) == len(rerun) == 6  # gpt2-tiny: embed, 4 blocks, head
    # A block's re-run saves much more than its input, which is all it keeps; the head
    # keeps the loss's log-probabilities, which no recompute of the head frees.
    assert rerun[1] > 10 * kept[1]
    assert kept[-1] > rerun[-1] > 0


def test_stages_recompute_only_where_the_backward_sees_the_forwards_weights() -> None:
    assert recompute_allowed(_pipeline(), pipeline_schedule(_pipeline())) == [True] * 4
    for weights, expected in (("spectrain", False), ("stash", True)):
        config = _pipeline(schedule="async-1f1b", weights=weights, micro_batches=1)
        allowed = recompute_allowed(config, pipeline_schedule(config))
        assert allowed[-1]  # the last stage runs a unit's backward right after its forward
        assert all(allowed) is expected
    config = _pipeline(schedule="async-1f1b", weights="spectrain", micro_batches=1)
    plans = _plans(config, "hybrid", footprint_ratio=1.2)
    for plan, may in zip(plans.plans, plans.recompute_allowed):
        assert may or not plan.recomputed


def _same_bits_within_budget(
    swapping: TrainConfig, plain: TrainConfig, *, metered: bool = True
) -> Any:
    """Run both; check the bits, the ledger and (``metered``) the device's meter; return
    the swapping run's ``stage_swap`` report, ``unswapped`` the plain run's meter per rank."""
    ran, reference = _runs(swapping, plain)
    assert ran.losses == reference.losses
    assert ran.stage_sha256 == reference.stage_sha256
    assert ran.params_sha256 == reference.params_sha256
    swap = ran.to_report()["stage_swap"]
    stages = swap["stages"]
    for rank, measured in enumerate(swap["measured"]):
        stage = stages[rank % len(stages)]
        assert 0 < measured["peak_saved_bytes"] <= stage["saved_budget_bytes"], (rank, swap)
        assert measured["late_fetches"] == 0 and measured["unmatched"] == 0
        # The device's own meter, not the ledger: the stage held no more than its plan
        # counted, so no more than the budget (which save-on-cpu ignores).
        peak = measured["peak_resident_bytes"]
        assert peak > 0
        if metered:
            assert peak <= stage["planned_peak_bytes"] * 1.02, (rank, peak, stage)
            if swap["policy"] != "save-on-cpu":
                assert peak <= swap["budget_bytes"] * 1.02, (rank, peak, swap["budget_bytes"])
    assert ran.peak_resident_bytes == tuple(m["peak_resident_bytes"] for m in swap["measured"])
    return {**swap, "unswapped": list(reference.peak_resident_bytes)}


@cache
def _runs(swapping: TrainConfig, plain: TrainConfig) -> tuple[Any, Any]:
    """Both runs, once per pair of configs (tests of processes share theirs)."""
    ran, reference = run_pipeline(swapping), run_pipeline(plain)
    assert ran is not None and reference is not None
    return ran, reference


@pytest.mark.parametrize(
    "stages,fields,policy,ratio",
    [
        (4, {"schedule": "1f1b"}, "disjoint", 1.25),
        (4, {"schedule": "1f1b"}, "hybrid", 1.3),
        (2, {"schedule": "gpipe", "micro_batches": 4}, "oblivious", 1.5),
        (4, {"schedule": "async-1f1b", "weights": "spectrain", "micro_batches": 1}, "auto", 1.2),
        (4, {"schedule": "2bw", "weights": "stash", "micro_batches": 2}, "recompute", 1.1),
    ],
)
def test_an_emulated_pipeline_that_swaps_is_bit_identical_and_within_budget(
    stages: int, fields: dict[str, Any], policy: str, ratio: float
) -> None:
    plain = _pipeline(stages, **fields, emulate=True)
    swap = _same_bits_within_budget(_swapping(plain, policy, footprint_ratio=ratio), plain)
    moved = [m["swapped_bytes"] > 0 or m["recomputed_layers"] for m in swap["measured"]]
    assert any(moved)  # the budget made some stage swap or recompute


@pytest.mark.parametrize(
    "schedule,policy,ratio",
    [
        ("gpipe", "save-on-cpu", None),
        ("gpipe", "disjoint", 1.5),
        ("gpipe", "recompute", 1.5),
        ("1f1b", "recompute", 1.25),
    ],
)
def test_two_stages_that_swap_hold_the_budget_as_the_device_counts_it(
    schedule: str, policy: str, ratio: float | None
) -> None:
    plain = _pipeline(2, schedule=schedule, micro_batches=4, emulate=True)
    budget = {} if ratio is None else {"footprint_ratio": ratio}
    swap = _same_bits_within_budget(_swapping(plain, policy, **budget), plain)
    assert len(swap["measured"]) == 2
    # A stage that swapped or recomputed held less than it does without its plan.
    moved = [m["swapped_bytes"] > 0 or bool(m["recomputed_layers"]) for m in swap["measured"]]
    assert any(moved)
    for measured, unswapped, did in zip(swap["measured"], swap["unswapped"], moved, strict=True):
        if did:
            assert measured["peak_resident_bytes"] < unswapped


@pytest.mark.dist
def test_two_stages_that_swap_in_processes_hold_the_budget_as_the_device_counts_it() -> None:
    plain = _pipeline(2, schedule="gpipe", micro_batches=4)
    swap = _same_bits_within_budget(_swapping(plain, "disjoint", footprint_ratio=1.5), plain)
    assert all(m["swapped_bytes"] > 0 for m in swap["measured"])


@pytest.mark.slow  # make test-slow; make test keeps a smaller case of it
@pytest.mark.dist
def test_stages_that_swap_in_processes_equal_the_pipeline_without_swapping() -> None:
    plain = _pipeline(4, schedule="1f1b")
    swapping = _swapping(plain, "disjoint", footprint_ratio=1.25)
    # The device's meter: the next test.
    swap = _same_bits_within_budget(swapping, plain, metered=False)
    assert swap["measured"][0]["swapped_bytes"] > 0
    assert len(swap["measured"]) == 4


@pytest.mark.slow  # two stages that swap in processes hold the budget in make test
@pytest.mark.dist
@pytest.mark.xfail(
    strict=True,
    reason="within the budget now (stage 1: 1,703,936 bytes held, a budget of 1,937,408; "
    "gloo's sends are let go when their peer has them: a unit's activations when its "
    "gradient comes back, the rest at a synchronous step's end), but 5% over the plan's "
    "1,622,016: a stage's gradients sent back in a step stay held until the step ends",
)
def test_four_stages_that_swap_in_processes_hold_the_budget_as_the_device_counts_it() -> None:
    plain = _pipeline(4, schedule="1f1b")
    swapping = _swapping(plain, "disjoint", footprint_ratio=1.25)
    _same_bits_within_budget(swapping, plain)  # the runs of the test above


def test_a_pipeline_that_swaps_resumes_from_its_checkpoint_as_if_left_alone(tmp_path: Any) -> None:
    args = ["train", "--model", "gpt2-tiny", "--seq-len", "32", "--batch", "16", "--steps", "4"]
    args += ["--pipeline", "4", "--micro-batches", "8", "--balance", "2,1,1,2", "--emulate"]
    # The ratio was set for SGD's one state buffer (AdamW's two leave too little to swap).
    args += ["--optimizer", "sgd", "--swap-policy", "disjoint", "--footprint-ratio", "1.25"]
    folder = tmp_path / "ck"
    reports = [tmp_path / f"{name}.json" for name in ("whole", "resumed")]
    assert main([*args, "--report", str(reports[0])]) == 0
    assert main([*args, "--checkpoint-dir", str(folder), "--checkpoint-every", "2"]) == 0
    shutil.rmtree(folder / "step-00000004")  # as if stopped after step 2
    assert main([*args, "--resume", str(folder), "--report", str(reports[1])]) == 0
    whole, resumed = (json.loads(r.read_text()) for r in reports)
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["losses"] == whole["losses"]
