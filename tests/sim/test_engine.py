"""Tests of the event-driven simulator (pipeswap.sim.engine): closed forms and invariants.

Covers: pipeswap/sim/engine.py.
"""

import importlib.util
import pathlib
import random
import time

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Link, Node, Topology
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.engine import DeadlockError, OutOfMemoryError, simulate
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.task_streams import task_streams

GB = 10**9
REL = 1e-9


def _switch(copy_engines: int = 2, duplex: float = 1.0, memory: int = 0) -> Topology:
    """Two GPUs behind one switch; every link 12 GB/s per direction."""
    nodes = (
        Node("cpu0", "cpu"),
        Node("sw0", "switch"),
        Node("gpu0", "gpu", copy_engines, memory),
        Node("gpu1", "gpu", copy_engines, memory),
    )
    links = (
        Link("sw0", "cpu0", 12.0, duplex),
        Link("gpu0", "sw0", 12.0, duplex),
        Link("gpu1", "sw0", 12.0, duplex),
    )
    return Topology("switch-2", nodes, links)


def _star(n: int, gb_per_s: float = 12.0) -> Topology:
    """``n`` GPUs, each on its own link to one CPU (like direct-4)."""
    nodes = (Node("cpu0", "cpu"),) + tuple(Node(f"gpu{i}", "gpu") for i in range(n))
    links = tuple(Link(f"gpu{i}", "cpu0", gb_per_s) for i in range(n))
    return Topology(f"star-{n}", nodes, links)


def _times(result, task_id: str) -> tuple[float, float]:
    timing = result.tasks[task_id]
    return timing.start_s, timing.end_s


def test_one_transfer_takes_bytes_over_bandwidth() -> None:
    b = GraphBuilder()
    b.d2h("gpu0", 12 * GB, id="out")
    result = simulate(b.build(), _switch())
    assert _times(result, "out") == pytest.approx((0.0, 1.0), rel=REL)
    assert result.makespan_s == pytest.approx(1.0, rel=REL)


def test_two_gpus_behind_one_switch_share_its_uplink() -> None:
    b = GraphBuilder()
    b.d2h("gpu0", 12 * GB, id="a")
    b.d2h("gpu1", 12 * GB, id="b")
    result = simulate(b.build(), _switch())
    assert result.tasks["a"].end_s == pytest.approx(2.0, rel=REL)
    assert result.tasks["b"].end_s == pytest.approx(2.0, rel=REL)
    uplink = result.links[0]
    assert (uplink.a, uplink.b) == ("sw0", "cpu0")
    assert uplink.bytes_ab == 24 * GB and uplink.bytes_ba == 0
    assert uplink.busy_s_ab == pytest.approx(2.0, rel=REL) and uplink.busy_s_ba == 0.0


def test_opposite_directions_do_not_slow_each_other() -> None:
    b = GraphBuilder()
    b.d2h("gpu0", 12 * GB, id="out")
    b.h2d("gpu0", 12 * GB, id="in")
    result = simulate(b.build(), _switch())
    assert result.tasks["out"].end_s == pytest.approx(1.0, rel=REL)
    assert result.tasks["in"].end_s == pytest.approx(1.0, rel=REL)


def test_water_filling_with_different_bottlenecks() -> None:
    # gpu2 sits behind a 3 GB/s link, so it gets 3 of the shared 12 GB/s uplink and the two
    # others 4.5 each. gpu2 (3 GB) ends at 1 s; then gpu0 and gpu1 have 4.5 GB left at 6 GB/s.
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
    b = GraphBuilder()
    b.d2h("gpu0", 9 * GB, id="a")
    b.d2h("gpu1", 9 * GB, id="b")
    b.d2h("gpu2", 3 * GB, id="c")
    result = simulate(b.build(), Topology("bottleneck", nodes, links))
    assert result.tasks["c"].end_s == pytest.approx(1.0, rel=REL)
    assert result.tasks["a"].end_s == pytest.approx(1.0 + 4.5 / 6.0, rel=REL)
    assert result.tasks["b"].end_s == pytest.approx(1.75, rel=REL)


def test_single_copy_engine_serializes_both_directions() -> None:
    b = GraphBuilder()
    b.d2h("gpu0", 12 * GB, id="out")
    b.h2d("gpu0", 12 * GB, id="in")
    result = simulate(b.build(), _switch(copy_engines=1))
    assert _times(result, "out") == pytest.approx((0.0, 1.0), rel=REL)
    assert _times(result, "in") == pytest.approx((1.0, 2.0), rel=REL)


def test_duplex_efficiency_slows_both_directions_while_both_carry_traffic() -> None:
    # At 0.5 both directions run at 6 GB/s; when the 6 GB h2d ends at 1 s the d2h has
    # 6 GB left and gets the full 12 GB/s back: 0.5 s more.
    b = GraphBuilder()
    b.d2h("gpu0", 12 * GB, id="out")
    b.h2d("gpu0", 6 * GB, id="in")
    result = simulate(b.build(), _switch(duplex=0.5))
    assert result.tasks["in"].end_s == pytest.approx(1.0, rel=REL)
    assert result.tasks["out"].end_s == pytest.approx(1.5, rel=REL)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ring_allreduce_matches_closed_form(n: int) -> None:
    # On a star every ring hop i -> i+1 uses gpu_i's uplink and gpu_{i+1}'s downlink, and no
    # other hop of the step does: each step moves S/n at the full B, 2(n-1) steps.
    size = 12 * GB
    gpus = [f"gpu{i}" for i in range(n)]
    b = GraphBuilder()
    b.allreduce(gpus, size, id="ar")
    result = simulate(b.build(), _star(n))
    assert result.tasks["ar"].end_s == pytest.approx(2 * (n - 1) / n * size / (12 * GB), rel=REL)
    for link in result.links:
        assert link.bytes_ab == link.bytes_ba == round(2 * (n - 1) * size / n)


def test_ring_allreduce_on_the_direct_4_preset() -> None:
    topology = preset("direct-4", gpu_memory_bytes=0)
    b = GraphBuilder()
    b.allreduce(topology.gpus, 8 * GB, id="ar")
    result = simulate(b.build(), topology)
    bandwidth = topology.links[0].bytes_per_s
    assert result.tasks["ar"].end_s == pytest.approx(2 * 3 / 4 * 8 * GB / bandwidth, rel=REL)


@pytest.mark.parametrize("n", [2, 4])
def test_a_calibrated_machine_times_collectives_as_measured(n: int) -> None:
    """A calibrated topology's all-reduce takes latency + S x 2(n-1)/n at the measured bus
    rate, and a p2p latency + S at its rate, whatever its links carry."""
    calibration = {
        "allreduce": {"latency_s": 3e-4, "bus_gb_per_s": 2.0},
        "p2p": {"latency_s": 1e-4, "gb_per_s": 4.0},
    }
    star = _star(n)
    topology = Topology(star.name, star.nodes, star.links, calibration=calibration)
    b = GraphBuilder()
    b.allreduce([f"gpu{i}" for i in range(n)], GB, id="ar")
    b.p2p("gpu0", "gpu1", GB, id="send", deps=["ar"])
    result = simulate(b.build(), topology)
    allreduce = 3e-4 + 2 * (n - 1) / n * GB / (2 * GB)
    assert result.tasks["ar"].end_s == pytest.approx(allreduce, rel=REL)
    assert result.tasks["send"].end_s == pytest.approx(allreduce + 1e-4 + 0.25, rel=REL)


def test_allreduce_over_one_gpu_and_zero_bytes_take_no_time() -> None:
    b = GraphBuilder()
    b.allreduce(["gpu0"], GB, id="alone")
    b.allreduce(["gpu0", "gpu1"], 0, id="empty")
    b.d2h("gpu0", 0, id="nothing")
    result = simulate(b.build(), _switch())
    assert result.makespan_s == 0.0


def test_memory_blocked_compute_starts_when_swap_out_frees() -> None:
    # 10 GB limit: f0 holds 8 GB; f1 needs 6 GB more, which exist only once the 6 GB d2h
    # (0.5 s at 12 GB/s, after f0 ends at 1 s) has freed them: f1 starts at exactly 1.5 s.
    b = GraphBuilder()
    f0 = b.compute("gpu0", 1.0, alloc_bytes=8 * GB, id="f0")
    b.d2h("gpu0", 6 * GB, deps=[f0], free_bytes=6 * GB, id="out")
    b.compute("gpu0", 1.0, alloc_bytes=6 * GB, id="f1")
    result = simulate(b.build(), _switch(), gpu_memory_bytes=10 * GB)
    assert result.tasks["out"].end_s == pytest.approx(1.5, rel=REL)
    assert result.tasks["f1"].start_s == result.tasks["out"].end_s
    stats = result.gpus["gpu0"]
    assert stats.busy_s == pytest.approx(2.0, rel=REL)
    assert stats.stall_s == pytest.approx(0.5, rel=REL)
    assert stats.peak_bytes == 8 * GB


def test_memory_limit_comes_from_the_topology_unless_overridden() -> None:
    b = GraphBuilder()
    b.compute("gpu0", 1.0, alloc_bytes=8 * GB, free_bytes=8 * GB, id="a")
    b.compute("gpu0", 1.0, alloc_bytes=8 * GB, free_bytes=8 * GB, id="b")
    graph = b.build()
    assert simulate(graph, _switch(memory=16 * GB)).gpus["gpu0"].peak_bytes == 8 * GB
    with pytest.raises(OutOfMemoryError):
        simulate(graph, _switch(memory=16 * GB), gpu_memory_bytes=4 * GB)


def test_dependency_chain_across_gpus() -> None:
    b = GraphBuilder()
    f = b.compute("gpu0", 1.0, id="f")
    send = b.p2p("gpu0", "gpu1", 12 * GB, deps=[f], id="send")
    g = b.compute("gpu1", 0.5, deps=[send], id="g")
    b.d2h("gpu1", 6 * GB, deps=[g], id="out")
    result = simulate(b.build(), _switch())
    assert _times(result, "send") == pytest.approx((1.0, 2.0), rel=REL)
    assert _times(result, "g") == pytest.approx((2.0, 2.5), rel=REL)
    assert _times(result, "out") == pytest.approx((2.5, 3.0), rel=REL)
    assert result.gpus["gpu1"].stall_s == pytest.approx(2.0, rel=REL)
    assert result.gpus["gpu0"].idle_s == pytest.approx(2.0, rel=REL)


def test_p2p_occupies_the_comm_stream_of_both_ends() -> None:
    b = GraphBuilder()
    b.p2p("gpu0", "gpu1", 12 * GB, id="first")
    b.p2p("gpu2", "gpu1", 12 * GB, id="second")
    result = simulate(b.build(), _star(3))
    assert _times(result, "second") == pytest.approx((1.0, 2.0), rel=REL)


def test_barrier_waits_for_every_gpu() -> None:
    b = GraphBuilder()
    a = b.compute("gpu0", 1.0)
    c = b.compute("gpu1", 2.0)
    bar = b.barrier(["gpu0", "gpu1"], deps=[a, c], id="bar")
    b.compute("gpu0", 1.0, deps=[bar], id="after")
    result = simulate(b.build(), _switch())
    assert _times(result, "bar") == (2.0, 2.0)
    assert _times(result, "after") == (2.0, 3.0)


def test_streams_run_in_graph_order() -> None:
    b = GraphBuilder()
    b.compute("gpu0", 1.0, id="a")
    b.compute("gpu0", 1.0, id="b")
    result = simulate(b.build(), _switch())
    assert _times(result, "b") == (1.0, 2.0)


def test_out_of_memory_names_gpu_task_and_sizes() -> None:
    b = GraphBuilder()
    b.compute("gpu1", 1.0, alloc_bytes=3 * GB, id="weights")
    b.compute("gpu1", 1.0, alloc_bytes=2 * GB, id="big")
    with pytest.raises(OutOfMemoryError) as caught:
        simulate(b.build(), _switch(), gpu_memory_bytes=4 * GB)
    err = caught.value
    found = (err.gpu, err.task, err.asked, err.in_use, err.limit)
    assert found == ("gpu1", "big", 2 * GB, 3 * GB, 4 * GB)
    message = str(err)
    for part in ("gpu1", "'big'", "2000000000", "3000000000", "4000000000", "gpu_memory_bytes"):
        assert part in message
    assert "Raise the limit ({gpu_memory_bytes})" in err.message  # the CLI says --gpu-memory
    assert isinstance(err, ConfigError) and isinstance(err, PipeswapError)


def test_deadlock_from_stream_order_names_the_tasks() -> None:
    graph = TaskGraph.from_json(
        {
            "format": "pipeswap.graph/1",
            "tasks": [
                {
                    "id": "late",
                    "kind": "compute",
                    "gpu": "gpu0",
                    "duration_s": 1,
                    "deps": ["early"],
                },
                {"id": "early", "kind": "compute", "gpu": "gpu0", "duration_s": 1},
            ],
        }
    )
    with pytest.raises(DeadlockError, match="'late' waits for 'early'.*queued behind 'late'"):
        simulate(graph, _switch())


def test_unknown_gpu_and_over_free_are_refused() -> None:
    b = GraphBuilder()
    b.compute("gpu7", 1.0, id="lost")
    with pytest.raises(PipeswapError, match="'lost' runs on 'gpu7'.*gpu0, gpu1"):
        simulate(b.build(), _switch())
    b = GraphBuilder()
    b.compute("gpu0", 1.0, free_bytes=5, id="greedy")
    with pytest.raises(PipeswapError, match="'greedy' frees 5 bytes"):
        simulate(b.build(), _switch())


def test_design_contract_example_runs_on_a_preset(contract_graph) -> None:
    graph = TaskGraph.from_json(contract_graph)
    result = simulate(graph, preset("switch-4"))
    # out0 and in0 each 6 GB at 12 GB/s; the allreduce is 2 steps of 2 GB at 12 GB/s.
    assert _times(result, "in0") == pytest.approx((1.5, 2.0), rel=REL)
    assert result.makespan_s == pytest.approx(2.0 + 2 * 2 / 12, rel=REL)
    obj = result.to_json()
    assert set(obj) >= {"makespan_s", "tasks", "gpus", "links"}
    assert obj["tasks"]["f0"] == {"start_s": 0.0, "end_s": 1.0}
    assert set(obj["gpus"]["gpu0"]) >= {"busy_s", "stall_s", "peak_bytes"}
    assert isinstance(obj["gpus"]["gpu0"]["peak_bytes"], int)
    for link in obj["links"]:
        assert set(link) >= {"a", "b", "bytes_ab", "bytes_ba", "busy_s_ab", "busy_s_ba"}
        assert isinstance(link["bytes_ab"], int) and isinstance(link["bytes_ba"], int)


def _random_graph(seed: int, gpus: list[str], count: int = 300) -> TaskGraph:
    rng = random.Random(seed)
    b = GraphBuilder()
    ids: list[str] = []
    held = {g: 0 for g in gpus}
    for _ in range(count):
        deps = rng.sample(ids, min(len(ids), rng.randrange(3)))
        gpu = rng.choice(gpus)
        kind = rng.choice(["compute", "compute", "d2h", "h2d", "p2p", "allreduce", "barrier"])
        nbytes = rng.randrange(1, 50) * 10**8
        if kind == "compute":
            alloc = rng.randrange(0, 4) * GB
            free = min(held[gpu], rng.randrange(0, 4) * GB)
            # Frees must follow the allocations they return; a chain on one GPU ensures it.
            held[gpu] += alloc - free
            ids.append(
                b.compute(gpu, rng.uniform(0, 0.5), deps=deps, alloc_bytes=alloc, free_bytes=free)
            )
        elif kind in ("d2h", "h2d"):
            ids.append(getattr(b, kind)(gpu, nbytes, deps=deps))
        elif kind == "p2p":
            src, dst = rng.sample(gpus, 2)
            ids.append(b.p2p(src, dst, nbytes, deps=deps))
        elif kind == "allreduce":
            ids.append(
                b.allreduce(rng.sample(gpus, rng.randrange(2, len(gpus) + 1)), nbytes, deps=deps)
            )
        else:
            ids.append(b.barrier(rng.sample(gpus, 2), deps=deps))
    return b.build()


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_respect_every_rule(seed: int) -> None:
    topology = preset("dual-root-8", gpu_memory_bytes=0)
    graph = _random_graph(seed, topology.gpus)
    result = simulate(graph, topology)
    again = simulate(graph, topology)
    assert again == result  # deterministic
    streams: dict[tuple[str, str], list[str]] = {}
    for task in graph.tasks:
        start, end = _times(result, task.id)
        assert 0.0 <= start <= end <= result.makespan_s
        for dep in task.deps:
            assert result.tasks[dep].end_s <= start
        for key in task_streams(task, topology):
            streams.setdefault(key, []).append(task.id)
    for ids in streams.values():  # FIFO, never two tasks at once on one stream
        for before, after in zip(ids, ids[1:]):
            assert result.tasks[before].end_s <= result.tasks[after].start_s
    assert result.makespan_s == max(t.end_s for t in result.tasks.values())
    for gpu, stats in result.gpus.items():
        busy = sum(t.duration_s for t in graph.tasks if t.kind == "compute" and t.gpu == gpu)
        assert stats.busy_s == pytest.approx(busy, rel=REL)
        total = stats.busy_s + stats.stall_s + stats.idle_s
        assert total == pytest.approx(result.makespan_s, rel=REL)
    for link, spec in zip(result.links, topology.links):
        bound = spec.bytes_per_s * max(link.busy_s_ab, 1e-300)
        assert link.bytes_ab <= bound * (1 + 1e-9)


def _swapping_graph(seed: int, gpus: list[str], count: int = 300) -> TaskGraph:
    """Computes that allocate, each followed by a d2h that frees what it allocated."""
    rng = random.Random(seed)
    b = GraphBuilder()
    ids: list[str] = []
    while len(b) < count:
        gpu = rng.choice(gpus)
        deps = rng.sample(ids, min(len(ids), rng.randrange(2)))
        alloc = rng.randrange(1, 4) * GB
        ids.append(b.compute(gpu, rng.uniform(0.01, 0.2), deps=deps, alloc_bytes=alloc))
        ids.append(b.d2h(gpu, alloc, deps=[ids[-1]], free_bytes=alloc))
    return b.build()


@pytest.mark.parametrize("seed", range(4))
def test_random_graphs_never_exceed_the_memory_limit(seed: int) -> None:
    # Every allocation fits alone and is freed by a d2h on another stream, so the run
    # must finish; tasks wait for memory, and usage never passes the limit.
    topology = preset("switch-4", gpu_memory_bytes=0)
    graph = _swapping_graph(seed, topology.gpus)
    limit = 5 * GB
    result = simulate(graph, topology, gpu_memory_bytes=limit)
    assert result.makespan_s > simulate(graph, topology).makespan_s
    for gpu in topology.gpus:
        changes = []
        for task in graph.tasks:
            if task.gpu == gpu:
                changes.append((result.tasks[task.id].start_s, 1, task.alloc_bytes))
                changes.append((result.tasks[task.id].end_s, 0, -task.free_bytes))
        used = 0
        for _, _, delta in sorted(changes):
            used += delta
            assert used <= limit
        assert 3 * GB <= result.gpus[gpu].peak_bytes <= limit


@pytest.mark.slow
def test_hundred_thousand_tasks_simulate_in_under_ten_seconds() -> None:
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "sim_speed.py"
    spec = importlib.util.spec_from_file_location("sim_speed", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    topology = preset("dual-root-8", gpu_memory_bytes=module.GPU_MEMORY_BYTES)
    graph = module.training_graph(100_000, topology.gpus, seed=0)
    started = time.perf_counter()
    simulate(graph, topology)
    assert time.perf_counter() - started < 10.0
