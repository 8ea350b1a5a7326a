"""The Topology contract: validation messages, JSON round trip, tree paths and host memory.

Covers: pipeswap/hardware/topology.py.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import TOPOLOGY_FORMAT, Link, Node, Topology

GIB = 2**30

# The example of design.md, exactly as written there.
DESIGN_EXAMPLE = {
    "format": "pipeswap.topology/1",
    "name": "two-behind-a-switch",
    "nodes": [
        {"id": "cpu0", "kind": "cpu"},
        {"id": "sw0", "kind": "switch"},
        {"id": "gpu0", "kind": "gpu", "copy_engines": 2, "memory_bytes": 34359738368},
        {"id": "gpu1", "kind": "gpu", "copy_engines": 2, "memory_bytes": 34359738368},
    ],
    "links": [
        {"a": "gpu0", "b": "sw0", "gb_per_s": 12.0},
        {"a": "gpu1", "b": "sw0", "gb_per_s": 12.0},
        {"a": "sw0", "b": "cpu0", "gb_per_s": 12.0},
    ],
}


def _dual_socket() -> Topology:
    """cpu0 - sw0 - {gpu0, gpu1};  cpu0 = cpu1 (inter-socket);  cpu1 - gpu2."""
    nodes = (
        Node("cpu0", "cpu"),
        Node("cpu1", "cpu"),
        Node("sw0", "switch"),
        Node("gpu0", "gpu", 2, 32 * GIB, "v100-32gb"),
        Node("gpu1", "gpu", 1, 11 * GIB),
        Node("gpu2", "gpu", 2, 0),
    )
    links = (
        Link("gpu0", "sw0", 12.0),
        Link("gpu1", "sw0", 12.0, duplex_efficiency=0.5),
        Link("sw0", "cpu0", 12.0),
        Link("cpu0", "cpu1", 20.0, kind="inter-socket"),
        Link("cpu1", "gpu2", 25.0),
    )
    return Topology("dual", nodes, links)


def _two_gpus(**link_options: float) -> tuple[tuple[Node, ...], tuple[Link, ...]]:
    nodes = (Node("cpu0", "cpu"), Node("sw0", "switch"), Node("gpu0", "gpu"), Node("gpu1", "gpu"))
    links = (
        Link("gpu0", "sw0", 12.0),
        Link("gpu1", "sw0", **{"gb_per_s": 12.0, **link_options}),
        Link("sw0", "cpu0", 12.0),
    )
    return nodes, links


# ---- validation: every error names what is wrong ---------------------------------------
def test_cycle_names_the_closing_link() -> None:
    nodes, links = _two_gpus()
    with pytest.raises(PipeswapError, match=r"link gpu1-gpu0 closes a cycle"):
        Topology("loop", nodes, (*links, Link("gpu1", "gpu0", 50.0)))


def test_duplicate_link_is_a_cycle() -> None:
    nodes, links = _two_gpus()
    with pytest.raises(PipeswapError, match=r"link sw0-cpu0 closes a cycle"):
        Topology("twice", nodes, (*links, Link("sw0", "cpu0", 12.0)))


def test_dangling_link_names_link_and_missing_node() -> None:
    nodes, links = _two_gpus()
    with pytest.raises(PipeswapError, match=r"link gpu7-sw0 is dangling: no node 'gpu7'"):
        Topology("dangling", nodes, (*links, Link("gpu7", "sw0", 12.0)))


def test_self_link_is_refused() -> None:
    nodes, links = _two_gpus()
    with pytest.raises(PipeswapError, match=r"link sw0-sw0 joins a node to itself"):
        Topology("self", nodes, (*links, Link("sw0", "sw0", 12.0)))


def test_gpu_without_path_to_cpu_is_named() -> None:
    nodes = (Node("cpu0", "cpu"), Node("sw0", "switch"), Node("gpu0", "gpu"), Node("gpu1", "gpu"))
    links = (Link("gpu0", "cpu0", 12.0), Link("gpu1", "sw0", 12.0))
    with pytest.raises(PipeswapError, match=r"gpu 'gpu1' has no path to a cpu"):
        Topology("island", nodes, links)


def test_no_cpu_at_all_is_refused() -> None:
    with pytest.raises(PipeswapError, match="has no cpu node"):
        Topology("headless", (Node("gpu0", "gpu"),), ())


@pytest.mark.parametrize("bandwidth", [0.0, -12.0, math.nan])
def test_non_positive_bandwidth_names_the_link(bandwidth: float) -> None:
    nodes, links = _two_gpus(gb_per_s=bandwidth)
    with pytest.raises(PipeswapError, match=r"link gpu1-sw0 has bandwidth .* must be positive"):
        Topology("slow", nodes, links)


@pytest.mark.parametrize("bandwidth", [1e300, 2e6, 1e-300])
def test_a_bandwidth_no_link_has_is_refused_before_it_overflows(bandwidth: float) -> None:
    nodes, links = _two_gpus(gb_per_s=bandwidth)
    with pytest.raises(PipeswapError, match=r"gpu1-sw0 has bandwidth .* between 1e-06 and 1e"):
        Topology("absurd", nodes, links)


@pytest.mark.parametrize("efficiency", [0.0, -0.5, 1.01, math.nan])
def test_bad_duplex_efficiency_names_the_link(efficiency: float) -> None:
    nodes, links = _two_gpus(duplex_efficiency=efficiency)
    with pytest.raises(PipeswapError, match=r"link gpu1-sw0 has duplex_efficiency .* \(0, 1\]"):
        Topology("duplex", nodes, links)


def test_duplicate_id_is_named() -> None:
    nodes, links = _two_gpus()
    with pytest.raises(PipeswapError, match=r"node id 'gpu1' appears twice"):
        Topology("dup", (*nodes, Node("gpu1", "gpu")), links)


@pytest.mark.parametrize("engines", [0, 3, -1])
def test_bad_copy_engines_names_the_gpu(engines: int) -> None:
    nodes, links = _two_gpus()
    nodes = (*nodes[:3], Node("gpu1", "gpu", copy_engines=engines))
    with pytest.raises(PipeswapError, match=rf"gpu 'gpu1' has copy_engines={engines}; use 1 or 2"):
        Topology("engines", nodes, links)


def test_unknown_kind_lists_the_kinds() -> None:
    nodes, links = _two_gpus()
    nodes = (*nodes[:1], Node("sw0", "nic"), *nodes[2:])
    with pytest.raises(
        PipeswapError, match=r"node 'sw0' has kind 'nic'; use one of gpu, switch, cpu"
    ):
        Topology("kinds", nodes, links)


def test_negative_memory_is_named() -> None:
    nodes, links = _two_gpus()
    nodes = (*nodes[:3], Node("gpu1", "gpu", memory_bytes=-1))
    with pytest.raises(PipeswapError, match=r"'gpu1' has negative memory_bytes"):
        Topology("memory", nodes, links)


def test_infinite_bandwidth_is_refused() -> None:
    nodes, links = _two_gpus(gb_per_s=math.inf)
    with pytest.raises(PipeswapError, match="gpu1-sw0"):
        Topology("infinite", nodes, links)


# ---- JSON ----------------------------------------------------------------------------
def test_design_example_is_accepted_and_round_trips_exactly() -> None:
    topology = Topology.from_json(DESIGN_EXAMPLE)
    assert topology.gpus == ["gpu0", "gpu1"]
    assert topology.cpus == ["cpu0"]
    assert topology.node("gpu0").memory_bytes == 32 * GIB
    assert topology.to_json() == DESIGN_EXAMPLE


def test_round_trip_keeps_every_field() -> None:
    topology = _dual_socket()
    obj = json.loads(json.dumps(topology.to_json()))
    assert obj["format"] == TOPOLOGY_FORMAT
    again = Topology.from_json(obj)
    assert again == topology
    assert again.node("gpu0").spec == "v100-32gb"
    assert again.links[1].duplex_efficiency == 0.5
    assert again.links[3].kind == "inter-socket"
    # Defaults are left out of the JSON.
    assert "duplex_efficiency" not in obj["links"][0] and "kind" not in obj["links"][0]
    assert obj["nodes"][0] == {"id": "cpu0", "kind": "cpu"}


def test_save_and_load(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dual.json"
    _dual_socket().save(path)
    assert Topology.load(path) == _dual_socket()


def test_wrong_format_and_malformed_json_are_refused() -> None:
    with pytest.raises(PipeswapError, match="expected format 'pipeswap.topology/1'"):
        Topology.from_json({**DESIGN_EXAMPLE, "format": "pipeswap.topology/0"})
    broken = json.loads(json.dumps(DESIGN_EXAMPLE))
    del broken["links"][0]["gb_per_s"]
    with pytest.raises(PipeswapError, match="malformed topology"):
        Topology.from_json(broken, where="broken.json")
    dangling = json.loads(json.dumps(DESIGN_EXAMPLE))
    dangling["links"][0]["b"] = "sw9"
    with pytest.raises(PipeswapError, match="no node 'sw9'"):
        Topology.from_json(dangling)


# ---- paths and host memory --------------------------------------------------------------
def test_path_follows_the_tree_with_directions() -> None:
    topology = _dual_socket()
    assert topology.path("gpu0", "gpu0") == []
    # gpu0 -> sw0 (link 0, a->b), sw0 -> cpu0 (link 2, a->b), cpu0 -> cpu1 (3, a->b),
    # cpu1 -> gpu2 (4, a->b).
    assert topology.path("gpu0", "gpu2") == [(0, 0), (2, 0), (3, 0), (4, 0)]
    # The way back uses the same links in the other direction.
    assert topology.path("gpu2", "gpu0") == [(4, 1), (3, 1), (2, 1), (0, 1)]
    # Peers under one switch never reach the CPU.
    assert topology.path("gpu0", "gpu1") == [(0, 0), (1, 1)]


def test_path_and_node_refuse_unknown_sources() -> None:
    with pytest.raises(PipeswapError, match="no node 'gpu9'; nodes: cpu0, cpu1, sw0"):
        _dual_socket().path("gpu9", "gpu0")


def test_path_refuses_unknown_destinations() -> None:
    with pytest.raises(PipeswapError, match="gpu9"):
        _dual_socket().path("gpu0", "gpu9")


def test_host_of_is_the_nearest_cpu() -> None:
    topology = _dual_socket()
    assert topology.host_of("gpu0") == "cpu0"
    assert topology.host_of("gpu1") == "cpu0"
    assert topology.host_of("gpu2") == "cpu1"


def test_with_gpu_memory_changes_only_gpus() -> None:
    topology = _dual_socket().with_gpu_memory(8 * GIB)
    assert [topology.node(g).memory_bytes for g in topology.gpus] == [8 * GIB] * 3
    assert topology.node("gpu1").copy_engines == 1
    assert topology.node("gpu0").spec == "v100-32gb"
    assert topology.links == _dual_socket().links
    # A calibrated machine stays calibrated: plans are scored as `simulate` scores them.
    measured = {"allreduce": {"latency_s": 3e-4, "bus_gb_per_s": 2.0}}
    base = _dual_socket()
    calibrated = Topology(base.name, base.nodes, base.links, calibration=measured)
    assert calibrated.with_gpu_memory(8 * GIB).calibration == measured


# ---- JSON fields: each refusal names the node or link and what to write ------------------
@pytest.mark.parametrize(
    "where, field, value, message",
    [
        ("nodes", "memory_bytes", 1.7, r"node 2 \('gpu0'\): memory_bytes is 1.7; write a whole"),
        ("nodes", "memory_bytes", -1, r"memory_bytes is -1; write a whole number of bytes >= 0"),
        ("nodes", "memory_bytes", "32GiB", r"memory_bytes is \"32GiB\""),
        ("nodes", "memory_bytes", True, r"memory_bytes is true"),
        ("nodes", "copy_engines", 1.5, r"copy_engines is 1.5; write 1 or 2"),
        ("nodes", "id", None, r"node 2: id is null; write a string"),
        ("nodes", "spec", 3, r"spec is 3; write a GPU spec name"),
        ("links", "gb_per_s", math.nan, r"link 0 \(gpu0-sw0\): gb_per_s is nan; write a finite"),
        ("links", "gb_per_s", math.inf, r"gb_per_s is inf; write a finite bandwidth > 0"),
        ("links", "gb_per_s", -12, r"gb_per_s is -12"),
        ("links", "gb_per_s", "12", r"gb_per_s is \"12\""),
        ("links", "duplex_efficiency", math.nan, r"duplex_efficiency is nan"),
    ],
)
def test_bad_json_fields_are_named(where: str, field: str, value: object, message: str) -> None:
    obj = json.loads(json.dumps(DESIGN_EXAMPLE))
    index = 2 if where == "nodes" else 0
    obj[where][index][field] = value
    with pytest.raises(PipeswapError, match=message):
        Topology.from_json(obj, where="server.json")


def test_whole_float_memory_is_accepted() -> None:
    obj = json.loads(json.dumps(DESIGN_EXAMPLE))
    obj["nodes"][2]["memory_bytes"] = 3.4e10  # a whole number written the short way
    assert Topology.from_json(obj).node("gpu0").memory_bytes == 34_000_000_000


def test_fractional_memory_is_refused_by_the_constructor_too() -> None:
    nodes, links = _two_gpus()
    nodes = (*nodes[:3], Node("gpu1", "gpu", memory_bytes=1.7))  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match=r"'gpu1' has memory_bytes 1.7; use a whole number"):
        Topology("memory", nodes, links)


def test_require_gpus_names_the_topology() -> None:
    cpu_only = Topology("cpu-only", (Node("cpu0", "cpu"),), ())
    with pytest.raises(PipeswapError, match=r"'cpu-only' \(from x.json\) has no GPU; add a node"):
        cpu_only.require_gpus("x.json")
    assert _dual_socket().require_gpus() == ["gpu0", "gpu1", "gpu2"]


@pytest.mark.parametrize("source", ["design", "dual-root-8"])
def test_fuzzed_topologies_load_or_raise_pipeswap_error(
    source: str, mutate: Callable[[object, random.Random], object]
) -> None:
    """Random damage to a valid file is either harmless or a PipeswapError, never a crash."""
    rng = random.Random(20261123)
    valid = DESIGN_EXAMPLE if source == "design" else preset(source).to_json()
    refused = 0
    for _ in range(200):
        mutant = mutate(valid, rng)
        try:
            topology = Topology.from_json(mutant)  # type: ignore[arg-type]
        except PipeswapError:
            refused += 1
            continue
        topology.to_json()  # what loaded is whole enough to write back
    assert refused > 50  # the mutations do reach the checks


def test_a_misspelt_key_of_a_node_or_link_is_refused() -> None:
    good = _dual_socket().to_json()
    for part, index, key in (("nodes", 1, "memory_byte"), ("links", 0, "gbps")):
        obj = json.loads(json.dumps(good))
        obj[part][index][key] = 1
        with pytest.raises(PipeswapError, match=f"unknown key {key!r}"):
            Topology.from_json(obj)


@pytest.mark.parametrize(
    "calibration, message",
    [
        (
            {"allreduce": {"latency_s": -5, "bus_gb_per_s": 2}},
            "latency_s is -5; write a finite number of seconds",
        ),
        ({"allreduce": {"latency_s": "x", "bus_gb_per_s": 2}}, 'latency_s is "x"'),
        ({"allreduce": {"latency_s": 0, "bus_gb_per_s": 0}}, "bus_gb_per_s is 0"),
        ({"allreduce": [1]}, "calibration allreduce: expected a JSON object"),
        ({"p2p": {"latency_s": 1e-4, "gb_per_s": 1e300}}, "between 1e-06 and 1e"),
        ({"compute_slowdown": -1}, "compute_slowdown is -1"),
    ],
)
def test_a_calibration_the_simulator_cannot_time_by_is_refused(
    calibration: dict, message: str
) -> None:
    obj = _dual_socket().to_json()
    obj["calibration"] = calibration
    with pytest.raises(PipeswapError, match=message):
        Topology.from_json(obj)
