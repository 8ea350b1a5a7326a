"""The layout planner: what it reports fits and re-simulates exactly; nothing fitting says
the smallest budget that works."""

from __future__ import annotations

import pytest
from layout_toys import GB, toy

from pipeswap.config_fields import ConfigError
from pipeswap.hardware.presets import preset
from pipeswap.layouts.layout import DATA_PARALLEL, PIPELINE, PIPELINE_DP, PIPELINE_SWAP
from pipeswap.layouts.search import SearchSpace, search_layouts
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph

SPACE = SearchSpace(schedules=("1f1b", "async-1f1b"), micro_factors=(1, 2))


def _resimulates(scored) -> None:
    again = simulate(TaskGraph.from_json(scored.graph.to_json()), scored.topology)
    assert again.makespan_s == scored.layout.graph_s
    assert max(g.peak_bytes for g in again.gpus.values()) == scored.layout.peak_bytes
    assert scored.layout.peak_bytes <= scored.layout.budget_bytes


def test_with_memory_to_spare_every_family_fits_and_every_graph_resimulates() -> None:
    profile = toy(8, saved_gb=0.5)
    search = search_layouts(profile, preset("switch-4"), 64 * GB, SPACE)
    families = {s.layout.family for s in search.scored}
    assert {DATA_PARALLEL, PIPELINE, PIPELINE_DP} <= families
    rates = [s.layout.samples_per_s for s in search.scored]
    assert rates == sorted(rates, reverse=True) and search.best.layout.samples_per_s == rates[0]
    for s in search.scored:
        _resimulates(s)
        assert s.layout.samples_per_step == 4 * profile.batch or s.layout.schedule == "async-1f1b"
    # Four GPUs never beat four times one GPU's compute.
    assert search.best.layout.samples_per_s <= 4 * profile.batch / profile.compute_s * 1.0001


def test_a_budget_data_parallelism_cannot_meet_is_met_by_stages_that_swap() -> None:
    # 8 GB of weights (16 GB with gradients) cannot sit on one 10 GB GPU; a quarter can,
    # but four units of activations in flight on stage 0 (8 GB) cannot without swapping.
    profile = toy(8, saved_gb=1.0, param_bytes=GB)
    search = search_layouts(profile, preset("switch-4"), 10 * GB, SPACE)
    assert search.best_of(DATA_PARALLEL) is None
    swapping = search.best_of(PIPELINE_SWAP)
    assert swapping is not None
    assert any(p.swapped or p.recomputed for p in swapping.layout.stage_plans)
    for family in (PIPELINE_SWAP, PIPELINE_DP):
        best = search.best_of(family)
        if best is not None:
            _resimulates(best)


def test_nothing_fitting_names_the_smallest_budget_that_works() -> None:
    profile = toy(8, saved_gb=4.0, param_bytes=GB)
    with pytest.raises(ConfigError, match="smallest budget that works is about") as info:
        search_layouts(profile, preset("switch-4"), GB, SPACE)
    smallest = int(str(info.value).split("is about ")[1].split(" ")[0])
    assert (
        search_layouts(profile, preset("switch-4"), smallest, SPACE).best.layout.peak_bytes
        <= smallest
    )
