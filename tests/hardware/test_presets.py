"""Preset server shapes: their trees, bandwidths, options and name/path resolution.

Covers: pipeswap/hardware/presets.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import (
    INTER_SOCKET_GB_PER_S,
    PCIE_GB_PER_S,
    preset,
    preset_description,
    preset_names,
    resolve_topology,
    topology_file,
)
from pipeswap.hardware.topology import Topology


def _links_on_path(topology: Topology, src: str, dst: str) -> set[tuple[str, str]]:
    return {(topology.links[i].a, topology.links[i].b) for i, _ in topology.path(src, dst)}


def test_names_and_descriptions() -> None:
    assert preset_names() == ["switch-4", "single-root-8", "dual-root-8", "direct-4"]
    for name in preset_names():
        assert preset_description(name)
        assert "\n" not in preset_description(name)


@pytest.mark.parametrize(
    ("name", "gpus", "cpus", "switches"),
    [
        ("switch-4", 4, 1, 2),
        ("single-root-8", 8, 1, 4),
        ("dual-root-8", 8, 2, 4),
        ("direct-4", 4, 1, 0),
    ],
)
def test_shape_counts_and_ids(name: str, gpus: int, cpus: int, switches: int) -> None:
    topology = preset(name)
    assert topology.name == name
    assert topology.gpus == [f"gpu{i}" for i in range(gpus)]
    assert topology.cpus == [f"cpu{i}" for i in range(cpus)]
    assert [n.id for n in topology.nodes if n.kind == "switch"] == [
        f"sw{i}" for i in range(switches)
    ]
    # A tree: one link fewer than nodes.
    assert len(topology.links) == len(topology.nodes) - 1


def test_switch_4_pairs_share_an_uplink() -> None:
    topology = preset("switch-4")
    assert _links_on_path(topology, "gpu0", "cpu0") == {("gpu0", "sw0"), ("sw0", "cpu0")}
    assert _links_on_path(topology, "gpu1", "cpu0") == {("gpu1", "sw0"), ("sw0", "cpu0")}
    assert _links_on_path(topology, "gpu2", "cpu0") == {("gpu2", "sw1"), ("sw1", "cpu0")}
    # Peer traffic within a switch stays below it; across switches it climbs to the CPU.
    assert _links_on_path(topology, "gpu0", "gpu1") == {("gpu0", "sw0"), ("gpu1", "sw0")}
    assert len(topology.path("gpu0", "gpu3")) == 4


def test_single_root_8_has_four_switches_of_two() -> None:
    topology = preset("single-root-8")
    for gpu_index in range(8):
        gpu = f"gpu{gpu_index}"
        assert topology.host_of(gpu) == "cpu0"
        assert _links_on_path(topology, gpu, "cpu0") == {
            (gpu, f"sw{gpu_index // 2}"),
            (f"sw{gpu_index // 2}", "cpu0"),
        }


def test_dual_root_8_crosses_the_inter_socket_link() -> None:
    topology = preset("dual-root-8", pcie="gen4")
    assert [topology.host_of(f"gpu{i}") for i in range(8)] == ["cpu0"] * 4 + ["cpu1"] * 4
    inter = [link for link in topology.links if link.kind == "inter-socket"]
    assert len(inter) == 1
    assert (inter[0].a, inter[0].b, inter[0].gb_per_s) == ("cpu0", "cpu1", INTER_SOCKET_GB_PER_S)
    assert INTER_SOCKET_GB_PER_S == 20.0
    assert ("cpu0", "cpu1") in _links_on_path(topology, "gpu0", "cpu1")
    assert ("cpu0", "cpu1") in _links_on_path(topology, "gpu1", "gpu6")
    assert ("cpu0", "cpu1") not in _links_on_path(topology, "gpu0", "gpu3")
    # The inter-socket link keeps its own bandwidth whatever the PCIe generation.
    assert all(link.gb_per_s == 25.0 for link in topology.links if link.kind == "pcie")


def test_direct_4_shares_no_link() -> None:
    topology = preset("direct-4")
    paths = [_links_on_path(topology, gpu, "cpu0") for gpu in topology.gpus]
    assert paths == [{(gpu, "cpu0")} for gpu in topology.gpus]


@pytest.mark.parametrize("pcie", ["gen3", "gen4", "gen5"])
def test_pcie_generation_sets_every_pcie_link(pcie: str) -> None:
    topology = preset("dual-root-8", pcie=pcie)
    expected = {"gen3": 12.0, "gen4": 25.0, "gen5": 50.0}[pcie]
    assert PCIE_GB_PER_S[pcie] == expected
    assert {link.gb_per_s for link in topology.links if link.kind == "pcie"} == {expected}
    assert topology.name == ("dual-root-8" if pcie == "gen3" else f"dual-root-8:{pcie}")


def test_options_reach_every_gpu_and_link() -> None:
    topology = preset(
        "switch-4",
        gpu_memory_bytes=11 * 2**30,
        copy_engines=1,
        duplex_efficiency=0.5,
        spec="rtx2080ti",
    )
    gpus = [topology.node(g) for g in topology.gpus]
    assert {(g.memory_bytes, g.copy_engines, g.spec) for g in gpus} == {
        (11 * 2**30, 1, "rtx2080ti")
    }
    assert {link.duplex_efficiency for link in topology.links} == {0.5}
    default = preset("switch-4")
    assert {(default.node(g).memory_bytes, default.node(g).copy_engines) for g in default.gpus} == {
        (32 * 2**30, 2)
    }


def test_bad_options_are_refused_with_the_valid_choices() -> None:
    with pytest.raises(PipeswapError, match="gen3, gen4, gen5"):
        preset("switch-4", pcie="gen7")
    with pytest.raises(PipeswapError, match="copy_engines=3"):
        preset("switch-4", copy_engines=3)
    with pytest.raises(PipeswapError, match="duplex_efficiency"):
        preset("switch-4", duplex_efficiency=1.5)
    with pytest.raises(PipeswapError, match="switch-4, single-root-8, dual-root-8, direct-4"):
        preset("switch-5")


@pytest.mark.parametrize("name", ["switch-4", "single-root-8", "dual-root-8", "direct-4"])
@pytest.mark.parametrize("pcie", ["gen3", "gen5"])
def test_json_round_trip(name: str, pcie: str) -> None:
    topology = preset(name, pcie=pcie, spec="v100-32gb", duplex_efficiency=0.75)
    text = json.dumps(topology.to_json())
    assert Topology.from_json(json.loads(text)) == topology


def test_resolve_preset_names_and_suffix() -> None:
    assert resolve_topology("switch-4") == preset("switch-4")
    assert resolve_topology("switch-4:gen4") == preset("switch-4", pcie="gen4")
    assert resolve_topology("switch-4", pcie="gen5") == preset("switch-4", pcie="gen5")
    assert resolve_topology("switch-4:gen4", pcie="gen4") == preset("switch-4", pcie="gen4")
    assert resolve_topology("direct-4", gpu_memory_bytes=2**30, copy_engines=1) == preset(
        "direct-4", gpu_memory_bytes=2**30, copy_engines=1
    )
    # A resolved name resolves back to the same topology.
    gen5 = preset("dual-root-8", pcie="gen5")
    assert resolve_topology(gen5.name) == gen5
    with pytest.raises(PipeswapError, match="give the generation once"):
        resolve_topology("switch-4:gen4", pcie="gen3")
    with pytest.raises(PipeswapError, match="gen3, gen4, gen5"):
        resolve_topology("switch-4:gen9")


def test_resolve_json_file(tmp_path: Path) -> None:
    topology = preset("dual-root-8", pcie="gen4", duplex_efficiency=0.5)
    path = tmp_path / "server.json"
    topology.save(path)
    assert resolve_topology(str(path)) == topology
    smaller = resolve_topology(str(path), gpu_memory_bytes=8 * 2**30)
    assert {smaller.node(g).memory_bytes for g in smaller.gpus} == {8 * 2**30}
    with pytest.raises(PipeswapError, match="pcie only apply to preset"):
        resolve_topology(str(path), pcie="gen3")
    with pytest.raises(PipeswapError, match="no such file"):
        resolve_topology(str(tmp_path / "missing.json"))
    with pytest.raises(PipeswapError, match=f"{tmp_path} is a directory; give a topology JSON"):
        resolve_topology(str(tmp_path))


def test_topology_file_is_none_for_presets() -> None:
    assert topology_file("dual-root-8") is None
    assert topology_file("switch-4:gen4") is None
    assert topology_file("server.json") == "server.json"


def test_resolve_unknown_lists_presets_and_mentions_files() -> None:
    with pytest.raises(PipeswapError) as info:
        resolve_topology("quad-root-16")
    message = str(info.value)
    assert "quad-root-16" in message
    for name in preset_names():
        assert name in message
    assert "JSON file" in message
    # The hint names the setting, not a flag: the CLI spells {json} as --json.
    assert isinstance(info.value, ConfigError)
    assert "pipeswap topology show NAME {json}" in info.value.message
    assert "pipeswap topology show NAME json" in message
