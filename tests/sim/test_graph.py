"""Tests of the task graph contract and builder (pipeswap.sim.graph).

Covers: pipeswap/sim/graph.py.
"""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.sim.graph import GraphBuilder, Task, TaskGraph


def _graph(*tasks: dict) -> dict:
    return {"format": "pipeswap.graph/1", "tasks": list(tasks)}


def test_contract_example_is_accepted_as_written(contract_graph) -> None:
    graph = TaskGraph.from_json(contract_graph)
    assert [t.id for t in graph.tasks] == ["f0", "out0", "in0", "act", "grads"]
    assert graph.task("out0") == Task("out0", "d2h", gpu="gpu0", bytes=6 * 10**9, deps=("f0",),
                                      free_bytes=6 * 10**9)
    assert graph.task("grads").gpus == ("gpu0", "gpu1")
    assert graph.gpus == ["gpu0", "gpu1"]


def test_json_round_trip(tmp_path, contract_graph) -> None:
    graph = TaskGraph.from_json(contract_graph)
    assert TaskGraph.from_json(graph.to_json()) == graph
    path = tmp_path / "g.json"
    graph.save(path)
    assert TaskGraph.load(path) == graph
    assert graph.to_json()["tasks"][0] == contract_graph["tasks"][0]


@pytest.mark.parametrize(
    "task, message",
    [
        ({"id": "x", "kind": "sleep", "gpu": "gpu0"}, "'x' has kind 'sleep'; use one of compute"),
        ({"id": "x", "kind": "compute", "duration_s": 1}, "compute task 'x' needs a 'gpu'"),
        ({"id": "x", "kind": "d2h", "gpu": "gpu0", "bytes": -1}, "'x' has negative bytes"),
        ({"id": "x", "kind": "h2d", "gpu": "gpu0", "bytes": 1, "alloc_bytes": -5},
         "'x' has negative alloc_bytes"),
        ({"id": "x", "kind": "compute", "gpu": "gpu0", "duration_s": -1}, "'x' has duration_s -1"),
        ({"id": "x", "kind": "p2p", "src": "gpu0", "bytes": 1}, "'x' needs 'src' and 'dst'"),
        ({"id": "x", "kind": "p2p", "src": "gpu0", "dst": "gpu0", "bytes": 1}, "to itself"),
        ({"id": "x", "kind": "allreduce", "bytes": 1}, "'x' needs a non-empty 'gpus'"),
        ({"id": "x", "kind": "barrier", "gpus": ["gpu0", "gpu0"]}, "lists a GPU twice"),
        ({"id": "x", "kind": "d2h", "gpu": "gpu0", "bytes": 1.5}, "'x'.*whole number"),
        ({"kind": "compute"}, "needs an 'id' and a 'kind'"),
    ],
)
def test_bad_tasks_are_refused_by_name(task: dict, message: str) -> None:
    with pytest.raises(PipeswapError, match=message):
        TaskGraph.from_json(_graph(task))


def test_duplicate_ids_unknown_deps_and_cycles_are_refused() -> None:
    a = {"id": "a", "kind": "compute", "gpu": "gpu0", "duration_s": 1}
    with pytest.raises(PipeswapError, match="task id 'a' appears twice"):
        TaskGraph.from_json(_graph(a, a))
    with pytest.raises(PipeswapError, match="'a' depends on unknown task 'ghost'"):
        TaskGraph.from_json(_graph({**a, "deps": ["ghost"]}))
    with pytest.raises(PipeswapError, match="'a' depends on itself"):
        TaskGraph.from_json(_graph({**a, "deps": ["a"]}))
    cycle = _graph({**a, "deps": ["c"]}, {**a, "id": "b", "deps": ["a"]},
                   {**a, "id": "c", "deps": ["b"]}, {**a, "id": "d", "deps": ["c"]})
    rotations = "a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c"
    with pytest.raises(PipeswapError, match=f"dependency cycle: ({rotations})"):
        TaskGraph.from_json(cycle)


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.graph/1"):
        TaskGraph.from_json({"format": "pipeswap.profile/1", "tasks": []})


def test_builder_returns_ids_and_builds_the_same_graph_as_json(contract_graph) -> None:
    b = GraphBuilder()
    f0 = b.compute("gpu0", 1.0, alloc_bytes=8000000000, id="f0")
    out0 = b.d2h("gpu0", 6000000000, deps=[f0], free_bytes=6000000000, id="out0")
    in0 = b.h2d("gpu0", 6000000000, deps=[out0], alloc_bytes=6000000000, id="in0")
    act = b.p2p("gpu0", "gpu1", 1000000000, id="act")
    b.allreduce(["gpu0", "gpu1"], 4000000000, deps=[in0, act], id="grads")
    assert b.build() == TaskGraph.from_json(contract_graph)
    auto = GraphBuilder()
    ids = [auto.compute("gpu0", 0.1), auto.barrier(["gpu0", "gpu1"]), auto.compute("gpu0", 0.1)]
    assert len(set(ids)) == 3 and ids[1].startswith("barrier")
    with pytest.raises(PipeswapError, match="already in the graph"):
        auto.compute("gpu0", 0.1, id=ids[0])


def test_memory_gpus_follow_the_documented_rule() -> None:
    assert Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1).memory_gpus == ("gpu0",)
    assert Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1, gpu="gpu1").memory_gpus == ("gpu1",)
    assert Task("t", "allreduce", gpus=("gpu0", "gpu1"), bytes=1).memory_gpus == ("gpu0", "gpu1")
    with pytest.raises(PipeswapError, match="neither src nor dst"):
        Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1, gpu="gpu2")
