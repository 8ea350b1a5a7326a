"""The schedule table: a new schedule is one entry, and every place that must know one asks it.

A copy of each entry under a new name, registered for one test, goes through every place
that depends on the schedule (the config's defaults and checks, the builder, the
validator, the version distances and their delay-free form, the partitioner's memory
model, the grid, the per-layer delays, the emulator, and the layout planner with the
entry's default weight mode) and behaves exactly as the entry it copies. A name in no
entry is refused naming the valid ones, never a KeyError.

Covers: pipeswap/schedule/kinds.py (the twin), pipeswap/layouts/search.py (default weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from support import GB, pipeline_run, toy_profile

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.layouts.search import SearchSpace, search_layouts
from pipeswap.pipeline.delayed import schedule_delays
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.grid import render_grid
from pipeswap.pipeline.predict import delay_free_schedule, version_distances
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import SCHEDULES, ScheduleKind, schedule_kind
from pipeswap.schedule.modes import WEIGHT_MODES
from pipeswap.schedule.partition import extra_weight_copies, in_flight_units, stage_memory_bytes
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import build_schedule
from pipeswap.schedule.validate import validate
from pipeswap.train_config import TrainConfig

TWIN = "twin-schedule"


@pytest.fixture(params=list(SCHEDULES))
def twin(request: pytest.FixtureRequest) -> Iterator[tuple[ScheduleKind, ScheduleKind]]:
    """(an entry, its copy under another name in the table for the test only)."""
    kind = SCHEDULES[request.param]
    copy = dataclasses.replace(kind, name=TWIN)
    SCHEDULES[TWIN] = copy
    try:
        yield kind, copy
    finally:
        del SCHEDULES[TWIN]


def _profile() -> Profile:
    return toy_profile([(0.5,)] * 8, param_bytes=GB // 100)


def _delays(config: TrainConfig, **changes: object) -> tuple[int, ...] | str:
    """The per-layer delays of ``config`` changed by ``changes``, or the refusal's message."""
    try:
        return schedule_delays(replace_fields(config, **changes))
    except ConfigError as error:
        return error.message
    except PipeswapError as error:
        return str(error)


def _layouts(name: str) -> list[tuple[object, ...]]:
    """What the layout planner finds on schedule ``name`` alone (the schedule's name left out)."""
    space = SearchSpace(schedules=(name,), micro_factors=(1, 2), dp_policies=())
    search = search_layouts(_profile(), preset("switch-4"), 64 * GB, space)
    return [
        (
            s.layout.family,
            s.layout.stages,
            s.layout.micro_batches,
            s.layout.weights,
            s.layout.graph_s,
        )
        for s in search.scored
        if s.layout.schedule is not None
    ]


def test_a_copy_of_an_entry_is_one_entry_and_runs_everywhere_as_it(
    twin: tuple[ScheduleKind, ScheduleKind],
) -> None:
    kind, copy = twin
    name = kind.name
    micro = 2 if kind.takes_micro_batches else 1
    # The config: its default micro-batches and its refusals.
    for stages in (1, 3):
        mine, theirs = (
            PipelineConfig(stages=stages, schedule=TWIN),
            PipelineConfig(stages=stages, schedule=name),
        )
        assert mine.schedule_kind is copy
        assert mine.micro_batch_count == theirs.micro_batch_count
        assert mine.asynchronous == theirs.asynchronous
    if not kind.takes_micro_batches:
        with pytest.raises(ConfigError, match=f"{TWIN} pipelines whole mini-batches"):
            PipelineConfig(stages=2, schedule=TWIN, micro_batches=2)
    # The builder, the validator, the version distances and the delay-free form.
    for stages in (1, 2, 4):
        built = build_schedule(TWIN, stages, 2 * stages + 3, micro)
        reference = build_schedule(name, stages, 2 * stages + 3, micro)
        validate(built)
        assert built.kind is copy and built.actions == reference.actions
        for k in range(stages):
            for rule in ("schedule", "official"):
                assert version_distances(built, k, rule) == version_distances(reference, k, rule)
        free, free_reference = delay_free_schedule(built), delay_free_schedule(reference)
        assert (free is None) == (free_reference is None)
        if free is not None and free_reference is not None:
            assert free.actions == free_reference.actions
        # The grid, captions included.
        assert render_grid(built).replace(TWIN, name) == render_grid(reference)
    # The partitioner's memory model, in every weight mode.
    for k in range(4):
        assert in_flight_units(TWIN, 4, k, micro) == in_flight_units(name, 4, k, micro)
    for weights in WEIGHT_MODES:
        assert extra_weight_copies(weights, 5, TWIN) == extra_weight_copies(weights, 5, name)
        memory = [
            stage_memory_bytes(
                _profile(), 2 * k, 2 * k + 2, k, 4, schedule=s, micro_batches=micro, weights=weights
            )
            for s in (TWIN, name)
            for k in range(4)
        ]
        assert memory[:4] == memory[4:]
    # The per-layer delays (the same, or the same refusal naming the schedule).
    run = pipeline_run("gpt2-micro", (2, 2), schedule=name, micro_batches=micro, steps=4)
    for weights in ("stale", "stash"):
        theirs_delays = _delays(run, weights=weights)
        mine_delays = _delays(run, weights=weights, schedule=TWIN)
        assert (
            mine_delays == theirs_delays
            if isinstance(theirs_delays, tuple)
            else str(mine_delays).replace(TWIN, name) == theirs_delays
        )
    # The layout planner, with the entry's default weight mode.
    assert copy.default_weights == kind.default_weights in WEIGHT_MODES
    assert _layouts(TWIN) == _layouts(name) != []


def test_a_copy_trains_one_step_in_the_emulator_as_its_entry(
    twin: tuple[ScheduleKind, ScheduleKind],
) -> None:
    kind, _ = twin
    config = pipeline_run(
        "gpt2-micro",
        (2, 2),
        schedule=kind.name,
        micro_batches=kind.default_micro_batches(2),
        batch=4,
        seq_len=16,
        steps=2,
    )
    mine = Emulator(replace_fields(config, schedule=TWIN)).run()
    theirs = Emulator(config).run()
    assert mine.losses == theirs.losses and mine.params_sha256 == theirs.params_sha256
    assert mine.to_report()["config"]["schedule"] == TWIN


def test_the_twin_leaves_with_its_fixture_and_unknown_names_are_refused() -> None:
    assert TWIN not in SCHEDULES
    valid = "valid: gpipe, 1f1b, async-1f1b, 2bw"
    with pytest.raises(ConfigError, match=f"unknown schedule '{TWIN}'; {valid}"):
        schedule_kind(TWIN)
    with pytest.raises(ConfigError, match=f"unknown schedule '{TWIN}'; {valid}"):
        search_layouts(_profile(), preset("switch-4"), 64 * GB, SearchSpace(schedules=(TWIN,)))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_entrys_default_weights_are_a_mode_its_config_takes(name: str) -> None:
    kind = schedule_kind(name)
    assert kind.default_weights in WEIGHT_MODES
    # A synchronous schedule runs on the live weights; an asynchronous one as its paper.
    assert (kind.default_weights == "stale") == (not kind.asynchronous)
    PipelineConfig(stages=2, schedule=name, weights=kind.default_weights)
