"""Which GPUs share a PCIe channel to host memory, on the presets' trees.

Covers: pipeswap/swap/plan/channels.py.
"""

from __future__ import annotations

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.channels import (
    channel_groups,
    group_shape,
    host_links,
    path_bytes_per_s,
    representative_group,
    shared_links,
)


def _names(topology, links) -> list[str]:
    return [f"{topology.links[link].a}-{topology.links[link].b}" for link in links]


def test_gpus_behind_one_switch_share_its_uplink() -> None:
    topology = preset("switch-4")
    assert _names(topology, host_links(topology, "gpu0")) == ["gpu0-sw0", "sw0-cpu0"]
    assert channel_groups(topology, topology.gpus) == [["gpu0", "gpu1"], ["gpu2", "gpu3"]]
    shared = shared_links(topology, topology.gpus)
    assert dict(zip(_names(topology, shared), shared.values())) == {
        "sw0-cpu0": ["gpu0", "gpu1"],
        "sw1-cpu0": ["gpu2", "gpu3"],
    }
    assert path_bytes_per_s(topology, "gpu3") == 12e9


def test_private_paths_make_groups_of_one() -> None:
    topology = preset("direct-4")
    assert channel_groups(topology, topology.gpus) == [[g] for g in topology.gpus]
    assert shared_links(topology, topology.gpus) == {}


def test_one_group_stands_for_all_only_when_every_group_has_its_shape() -> None:
    eight = preset("dual-root-8")
    groups = channel_groups(eight, eight.gpus)
    assert len({group_shape(eight, g) for g in groups}) == 1  # two sockets, one shape
    assert representative_group(eight, eight.gpus) == ["gpu0", "gpu1"]
    four = preset("switch-4")
    assert representative_group(four, ["gpu0", "gpu1", "gpu2"]) is None  # a pair and one
    assert representative_group(four, ["gpu0", "gpu1"]) is None  # one group: nothing to stand for
