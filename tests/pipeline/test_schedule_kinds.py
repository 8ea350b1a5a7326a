"""The schedule table: every entry through every place that asks it.

Each entry is built, validated, walked for its version distances (and its delay-free
form), held against its in-flight count and caption, read by the config, and run by the
emulator for one step.

Covers: pipeswap/schedule/kinds.py.
"""

from __future__ import annotations

import pytest
from support import pipeline_run

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.grid import render_grid
from pipeswap.pipeline.predict import delay_free_schedule, version_distances
from pipeswap.schedule.kinds import SCHEDULE_NAMES, SCHEDULES, schedule_kind
from pipeswap.schedule.orders import peak_in_flight
from pipeswap.schedule.partition import in_flight_units
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import build_schedule
from pipeswap.schedule.validate import validate

SHAPES = [(1, 1), (2, 2), (3, 2), (4, 4), (4, 1)]


def test_the_names_are_the_tables() -> None:
    assert SCHEDULE_NAMES == ("gpipe", "1f1b", "async-1f1b", "2bw") == tuple(SCHEDULES)
    assert all(schedule_kind(name).name == name for name in SCHEDULE_NAMES)
    with pytest.raises(ConfigError, match="unknown schedule 'zb'; valid: gpipe, 1f1b"):
        schedule_kind("zb")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("stages,micro", SHAPES)
def test_every_entry_builds_validates_and_walks(name: str, stages: int, micro: int) -> None:
    kind = schedule_kind(name)
    micro = micro if kind.takes_micro_batches else 1
    steps = 2 * stages + 3  # past the warm-up of every stage
    schedule = build_schedule(name, stages, steps, micro)
    validate(schedule)
    assert schedule.kind is kind and schedule.synchronous == (not kind.asynchronous)
    for k in range(stages):
        walked = version_distances(schedule, k)
        forwards = [s for (pass_kind, _), s in walked.items() if pass_kind == "F"]
        # A forward lags at most forward_lag updates; a synchronous schedule none at all.
        if kind.forward_lag is not None:
            assert max(forwards) <= kind.forward_lag
        if not kind.asynchronous:
            assert set(walked.values()) == {0}
        # The official SpecTrain table adds floor(k/2) where it applies, nowhere else.
        official = version_distances(schedule, k, "official")
        plus = k // 2 if kind.spectrain_table else 0
        assert official == {key: s + plus for key, s in walked.items()}
        # The memory model's in-flight count is the built order's peak.
        assert kind.in_flight_units(stages, k, micro) == peak_in_flight(schedule.compute_actions(k))
        assert in_flight_units(name, stages, k, micro) == kind.in_flight_units(stages, k, micro)
        # The grid's caption names the stage's phases.
        assert (
            "warm-up" in kind.caption(schedule.compute_actions(k), schedule.micro_batches)
            or name == "gpipe"
        )
    if stages > 1 and kind.asynchronous:
        assert max(version_distances(schedule, 0).values()) > 0
    # The delay-free form, where there is one, has every distance 0.
    free = delay_free_schedule(schedule)
    assert (free is None) == (kind.asynchronous and kind.delay_free is None)
    if free is not None:
        validate(free)
        assert all(set(version_distances(free, k).values()) <= {0} for k in range(stages))
    assert render_grid(schedule).startswith(f"{name}: {stages} stages")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_entry_sets_the_configs_defaults(name: str) -> None:
    kind = schedule_kind(name)
    config = PipelineConfig(stages=3, schedule=name)
    assert config.schedule_kind is kind and config.asynchronous == kind.asynchronous
    assert config.micro_batch_count == kind.default_micro_batches(3)
    assert config.micro_batch_count == (3 if kind.takes_micro_batches else 1)
    if kind.takes_micro_batches:
        assert PipelineConfig(stages=3, schedule=name, micro_batches=2).micro_batch_count == 2
    else:
        with pytest.raises(ConfigError, match=f"{name} pipelines whole mini-batches"):
            PipelineConfig(stages=3, schedule=name, micro_batches=2)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_entry_trains_one_step_in_the_emulator(name: str) -> None:
    kind = schedule_kind(name)
    config = pipeline_run(
        "gpt2-micro",
        (2, 2),
        schedule=name,
        micro_batches=kind.default_micro_batches(2),
        batch=4,
        seq_len=16,
        steps=1,
    )
    result = Emulator(config).run()
    # One step of any schedule is one step of synchronous 1F1B over the same micro-batches:
    # the same loss and the same updated weights, bit for bit.
    reference = Emulator(replace_fields(config, schedule="1f1b")).run()
    assert len(result.losses) == 1 and result.losses == reference.losses
    assert result.params_sha256 == reference.params_sha256
