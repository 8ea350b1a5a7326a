"""Tests of max-min fair link sharing (pipeswap.sim.flows).

Covers: pipeswap/sim/flows.py.
"""

import random

import pytest

from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.sim.flows import Flow, FlowNetwork, directed_path

GB = 1e9


def _bottleneck_topology() -> Topology:
    # gpu0, gpu1 under sw0 at 12 GB/s; gpu2 behind a 3 GB/s link sw1-sw0; uplink 12 GB/s.
    nodes = (
        Node("cpu0", "cpu"),
        Node("sw0", "switch"),
        Node("sw1", "switch"),
        Node("gpu0", "gpu"),
        Node("gpu1", "gpu"),
        Node("gpu2", "gpu"),
    )
    links = (
        Link("sw0", "cpu0", 12.0),
        Link("gpu0", "sw0", 12.0),
        Link("gpu1", "sw0", 12.0),
        Link("sw1", "sw0", 3.0),
        Link("gpu2", "sw1", 12.0),
    )
    return Topology("bottleneck", nodes, links)


def test_water_filling_with_a_flow_limited_elsewhere() -> None:
    topo = _bottleneck_topology()
    net = FlowNetwork(topo)
    gpus = ("gpu0", "gpu1", "gpu2")
    flows = [Flow(directed_path(topo, g, "cpu0"), 9 * GB, i) for i, g in enumerate(gpus)]
    for flow in flows:
        net.start(flow, 0.0)
    changed = net.settle(0.0)
    assert set(changed) == set(flows)
    # gpu2 is held to 3 GB/s by sw1->sw0; the other two split what is left of 12 GB/s.
    assert [f.rate for f in flows] == pytest.approx([4.5 * GB, 4.5 * GB, 3 * GB], rel=1e-12)
    assert flows[0].end == pytest.approx(2.0, rel=1e-12)


def test_only_changed_flows_are_reported() -> None:
    topo = _bottleneck_topology()
    net = FlowNetwork(topo)
    a = Flow(directed_path(topo, "gpu0", "cpu0"), GB, 0)
    b = Flow(directed_path(topo, "cpu0", "gpu1"), GB, 1)
    net.start(a, 0.0)
    net.settle(0.0)
    net.start(b, 0.5)
    # b goes the other way on disjoint directed links: a keeps its rate and its end time.
    assert net.settle(0.5) == [b]
    assert a.rate == b.rate == 12 * GB


def test_duplex_efficiency_scales_both_directions() -> None:
    nodes = (Node("cpu0", "cpu"), Node("gpu0", "gpu"))
    topo = Topology("duplex", nodes, (Link("gpu0", "cpu0", 12.0, duplex_efficiency=0.5),))
    net = FlowNetwork(topo)
    up = Flow(directed_path(topo, "gpu0", "cpu0"), GB, 0)
    net.start(up, 0.0)
    net.settle(0.0)
    assert up.rate == 12 * GB
    down = Flow(directed_path(topo, "cpu0", "gpu0"), GB, 1)
    net.start(down, 0.0)
    net.settle(0.0)
    assert up.rate == down.rate == 6 * GB


def test_busy_time_and_bytes_per_direction() -> None:
    topo = _bottleneck_topology()
    net = FlowNetwork(topo)
    flow = Flow(directed_path(topo, "gpu0", "cpu0"), 6 * GB, 0)
    net.start(flow, 1.0)
    net.settle(1.0)
    net.finish(flow, flow.end)
    up = 2 * 0  # sw0 -> cpu0 is link 0, direction a->b
    assert net.bytes[up] == 6 * GB and net.bytes[up + 1] == 0
    assert net.busy_s[up] == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_rates_are_max_min_fair(seed: int) -> None:
    # Max-min fairness <=> capacities hold and every flow crosses a saturated link on which
    # no other flow gets more than it does.
    rng = random.Random(seed)
    topo = _bottleneck_topology()
    ends = ["cpu0", "gpu0", "gpu1", "gpu2"]
    net = FlowNetwork(topo)
    flows = []
    for i in range(12):
        src, dst = rng.sample(ends, 2)
        flows.append(Flow(directed_path(topo, src, dst), GB, i))
        net.start(flows[-1], 0.0)
    net.settle(0.0)
    load: dict[int, float] = {}
    for f in flows:
        for dl in f.links:
            load[dl] = load.get(dl, 0.0) + f.rate
    capacity = {dl: topo.links[dl >> 1].bytes_per_s for dl in load}
    for dl, total in load.items():
        assert total <= capacity[dl] * (1 + 1e-12)
    for f in flows:
        assert any(
            load[dl] >= capacity[dl] * (1 - 1e-9)
            and all(g.rate <= f.rate * (1 + 1e-9) for g in flows if dl in g.links)
            for dl in f.links
        ), f"flow {f.owner} has no bottleneck link"


def test_recorded_rates_follow_changes() -> None:
    topo = _bottleneck_topology()
    net = FlowNetwork(topo, record_rates=True)
    flow = Flow(directed_path(topo, "gpu0", "cpu0"), 12 * GB, 0)
    net.start(flow, 0.0)
    net.settle(0.0)
    net.finish(flow, 1.0)
    net.settle(1.0)
    assert net.rates[0] == [(0.0, 12 * GB), (1.0, 0.0)]
