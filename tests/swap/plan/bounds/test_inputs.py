"""What the bounds read: one micro-batch's needs, and the case it runs in.

Covers: pipeswap/swap/plan/bounds/inputs.py.
"""

from __future__ import annotations

import pytest

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.bounds.inputs import BoundInputs

GB = 10**9


def test_needs_and_excess_closed_form(four_layers) -> None:
    w, budget = four_layers
    inputs = BoundInputs.of(w, preset("switch-4"), ["gpu0", "gpu1"], budget, 2)
    micro = inputs.micro
    assert micro.needs == [0, 0, 6 * GB, 12 * GB]
    assert micro.before == [0, 6 * GB, 12 * GB, 18 * GB]
    assert micro.excess(0, 3) == 12 * GB and micro.excess(2, 3) == 0
    assert inputs.relief is None and inputs.allowing(0.0).relief is None
    # Recomputing at most 0.05 s frees at most 0.05 / (1/16) of a 6 GB layer: 4.8 GB.
    allowed = inputs.allowing(0.05)
    assert allowed.relief is not None and allowed.relief.seconds == 0.05
    assert allowed.micro.excess(0, 3) == pytest.approx(12 * GB - 4.8 * GB)
    assert allowed.micro.excess(2, 3) == 0  # nothing to relieve


def test_the_case_names_each_links_users_and_each_gpus_path(four_layers) -> None:
    w, budget = four_layers
    topology = preset("switch-4")
    inputs = BoundInputs.of(w, topology, ["gpu0", "gpu1", "gpu2"], budget, 1)
    shared = {
        f"{topology.links[link].a}<->{topology.links[link].b}": members
        for link, members in inputs.users.items()
        if len(members) > 1
    }
    assert shared == {"sw0<->cpu0": ["gpu0", "gpu1"]}
    assert inputs.path_bytes_per_s("gpu2") == 12e9
    assert len(inputs.hops("gpu0")) == 2  # gpu0 -> sw0 -> cpu0
