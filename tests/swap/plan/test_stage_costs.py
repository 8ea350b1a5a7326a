"""stage_costs: per-unit compute and memory of each stage, as the partitioner counts them."""

from __future__ import annotations

import pytest
from layout_toys import GB, toy

from pipeswap.errors import PipeswapError
from pipeswap.schedule.partition import stage_memory_bytes
from pipeswap.swap.plan.stage_costs import stage_costs


def test_units_split_the_mini_batch_and_the_step_by_parameters() -> None:
    profile = toy(8)
    costs = stage_costs(profile, (3, 5), schedule="1f1b", micro_batches=4, weights="stale")
    assert [c.layers for c in costs] == [(0, 1, 2), (3, 4, 5, 6, 7)]
    assert sum(c.forward_s for c in costs) * 4 == pytest.approx(profile.forward_s)
    assert sum(c.backward_s for c in costs) * 4 == pytest.approx(profile.backward_s)
    assert [c.update_s for c in costs] == pytest.approx([0.5 * 3 / 8, 0.5 * 5 / 8])
    assert costs[0].saved == (GB // 4,) * 3
    assert [c.in_flight for c in costs] == [2, 1]


@pytest.mark.parametrize(
    "schedule,weights", [("1f1b", "stale"), ("async-1f1b", "spectrain"), ("2bw", "stash")]
)
def test_resident_plus_in_flight_activations_is_the_partitioners_memory(
    schedule: str, weights: str
) -> None:
    profile = toy(8)
    micro = 1 if schedule == "async-1f1b" else 4
    costs = stage_costs(
        profile, (2, 2, 2, 2), schedule=schedule, micro_batches=micro, weights=weights
    )
    for c in costs:
        a, b = c.layers[0], c.layers[-1] + 1
        expected = stage_memory_bytes(
            profile, a, b, c.stage, 4, schedule=schedule, micro_batches=micro, weights=weights
        )
        assert c.resident_bytes + c.in_flight * c.saved_bytes == expected


def test_a_balance_must_cover_the_profile() -> None:
    with pytest.raises(PipeswapError, match="covers 7 layers"):
        stage_costs(toy(8), (3, 4), schedule="1f1b", micro_batches=2, weights="stale")
