"""PipeDream-2BW: the schedule's version rule, its delay-free form, runtime == emulator.

Covers: pipeswap/schedule/timetable.py (two_bw_orders), pipeswap/pipeline/predict.py
(version_distances, delay_free_schedule), pipeswap/schedule/validate.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from runtime_check import assert_runtime_matches_emulator
from support import pipeline_run

import pipeswap.pipeline.emulator as emulator_module
from pipeswap.config_fields import replace_fields
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.grid import render_grid
from pipeswap.pipeline.predict import delay_free_schedule, version_distances
from pipeswap.schedule.partition import extra_weight_copies, in_flight_units
from pipeswap.schedule.timetable import Schedule, build_schedule, unit_time_order
from pipeswap.schedule.validate import ScheduleError, validate
from pipeswap.train_config import TrainConfig

SHAPES = [(1, 3), (2, 1), (2, 2), (3, 2), (4, 4), (4, 2), (3, 5)]


def _positions(schedule: Schedule, rank: int) -> dict[tuple[str, int], int]:
    return {(a.kind, a.unit): i for i, a in enumerate(schedule.compute_actions(rank))}


@pytest.mark.parametrize("stages,micro", SHAPES)
def test_forwards_of_t_run_between_update_t_minus_2_and_t_minus_1(stages: int, micro: int) -> None:
    steps = 5
    schedule = build_schedule("2bw", stages, steps, micro)
    validate(schedule)
    for rank in range(stages):
        at = _positions(schedule, rank)
        for unit in range(schedule.num_units):
            t = schedule.step_of(unit)
            if t >= 2:
                assert at[("UPDATE", t - 2)] < at[("F", unit)]
            if t >= 1:
                assert at[("F", unit)] < at[("UPDATE", t - 1)] < at[("B", unit)]
            assert at[("B", unit)] < at[("UPDATE", t)]
        # One UPDATE per mini-batch, right after a backward (no flush needed for it).
        assert [a.unit for a in schedule.compute_actions(rank) if a.kind == "UPDATE"] == list(
            range(steps)
        )


@pytest.mark.parametrize("stages,micro", SHAPES)
def test_version_distance_is_one_at_every_stage(stages: int, micro: int) -> None:
    schedule = build_schedule("2bw", stages, 5, micro)
    for rank in range(stages):
        distances = version_distances(schedule, rank)
        for unit in range(schedule.num_units):
            forward = 0 if schedule.step_of(unit) == 0 else 1
            assert distances[("F", unit)] == forward, (rank, unit)
            assert distances[("B", unit)] == 0, (rank, unit)
        # The official SpecTrain table is for async-1f1b: 2bw keeps the walk.
        assert version_distances(schedule, rank, "official") == distances


def test_2bw_has_no_flush_and_beats_1f1b() -> None:
    def makespan(schedule: Schedule) -> float:
        return max(t.end for t in unit_time_order(schedule, forward_cost=1, backward_cost=2))

    for stages, micro in [(2, 2), (4, 4), (4, 8)]:
        two_bw = makespan(build_schedule("2bw", stages, 8, micro))
        one_f = makespan(build_schedule("1f1b", stages, 8, micro))
        assert two_bw < 0.8 * one_f
        # Delay 0 flushes like 1f1b: the same makespan.
        assert makespan(build_schedule("2bw", stages, 8, micro, delay=0)) == one_f


def test_grid_prints_2bw() -> None:
    grid = render_grid(build_schedule("2bw", 2, 4, 2))
    assert grid.startswith("2bw: 2 stages, 4 steps, 8 micro-batches")
    assert "no flush, UPDATE after every 2 B (a mini-batch)" in grid
    assert "B7/U3" in grid and "/U0" in grid


def test_delay_zero_is_synchronous_and_bad_delays_are_refused() -> None:
    schedule = build_schedule("2bw", 3, 4, 3)
    free = delay_free_schedule(schedule)
    assert free is not None and free.name == "2bw"
    validate(free)
    for rank in range(3):
        assert set(version_distances(free, rank).values()) == {0}
    assert delay_free_schedule(build_schedule("async-1f1b", 3, 4)) is None
    one = build_schedule("1f1b", 3, 4, 3)
    assert delay_free_schedule(one) is one
    with pytest.raises(PipeswapError, match="delay"):
        build_schedule("2bw", 2, 2, 2, delay=2)


def test_validator_refuses_a_forward_two_updates_stale() -> None:
    # Stage 0's forward of mini-batch 2 moved before UPDATE(0): three versions in use.
    text = build_schedule("2bw", 1, 3, 1).to_string()
    assert text == "0: 0F0 0B0 0F1 0UPDATE0 0B1 0F2 0UPDATE1 0B2 0UPDATE2"
    bad = Schedule.from_string(
        "0: 0F0 0F1 0F2 0B0 0UPDATE0 0B1 0UPDATE1 0B2 0UPDATE2",
        name="2bw",
        num_steps=3,
        micro_batches=1,
    )
    with pytest.raises(ScheduleError, match="0F2 comes before 0UPDATE0"):
        validate(bad)


def test_memory_model_counts_two_versions() -> None:
    # Stash keeps the second version only, whatever the number in flight.
    assert extra_weight_copies("stash", 8, "2bw") == 1
    assert extra_weight_copies("stash", 8, "async-1f1b") == 8
    assert extra_weight_copies("stale", 8, "2bw") == 0
    # Activations: at most 2m micro-batches, m on the last stage.
    assert [in_flight_units("2bw", 4, k, 4) for k in range(4)] == [8, 8, 7, 4]


def _emulate(config: TrainConfig) -> dict[str, Any]:
    return Emulator(config).run().to_report()


def test_2bw_with_delay_disabled_equals_synchronous_gradient_accumulation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """delay=0: 2bw's forwards wait for the previous update, so every pass runs on the
    weights its mini-batch's update is applied to: 1f1b's training, bit for bit (the same
    micro-batch gradients summed in the same order; only the pass interleaving differs)."""
    base = pipeline_run(
        "gpt2-micro", (2, 1, 1), batch=8, micro_batches=4, seq_len=16, steps=4, lr=0.05
    )
    reference = _emulate(replace_fields(base, schedule="1f1b"))
    real_build = emulator_module.build_schedule

    def delay_zero(name: str, *args: Any, **kwargs: Any) -> Schedule:
        return real_build(name, *args, **({"delay": 0} if name == "2bw" else {}), **kwargs)

    monkeypatch.setattr(emulator_module, "build_schedule", delay_zero)
    emulator_module._validated.cache_clear()  # a run's schedule is built once per process
    for weights in ("stale", "stash"):
        free = _emulate(replace_fields(base, schedule="2bw", weights=weights))
        assert free["losses"] == reference["losses"], weights
        assert free["params_sha256"] == reference["params_sha256"], weights
    monkeypatch.undo()
    emulator_module._validated.cache_clear()
    # With the delay (the default) training differs: the comparison is not vacuous.
    delayed = _emulate(replace_fields(base, schedule="2bw", weights="stash"))
    assert delayed["losses"][0] == reference["losses"][0]
    assert delayed["params_sha256"] != reference["params_sha256"]


MODES = [("stash", "sgd"), ("stale", "sgd"), ("spectrain", "sgd")]


@pytest.mark.dist
@pytest.mark.parametrize("stages", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_2bw_runtime_bitwise_equal_to_emulator(stages: int) -> None:
    base = pipeline_run(
        "gpt2-micro",
        (4 // stages,) * stages,
        schedule="2bw",
        batch=8,
        micro_batches=stages,
        seq_len=16,
        steps=4,
        lr=0.05,
        momentum=0.9,
    )
    configs = [replace_fields(base, weights=w, optimizer=o) for w, o in MODES]
    reports = assert_runtime_matches_emulator(configs, stages)
    # The modes really train differently.
    assert len({r["params_sha256"] for r in reports}) == len(MODES)
