"""Tests of the task graph contract (pipeswap.sim.graph).

Covers: pipeswap/sim/graph.py.
"""

import math
import random

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.sim.graph import Task, TaskGraph


def _graph(*tasks: dict) -> dict:
    return {"format": "pipeswap.graph/1", "tasks": list(tasks)}


def test_contract_example_is_accepted_as_written(contract_graph) -> None:
    graph = TaskGraph.from_json(contract_graph)
    assert [t.id for t in graph.tasks] == ["f0", "out0", "in0", "act", "grads"]
    assert graph.task("out0") == Task(
        "out0", "d2h", gpu="gpu0", bytes=6 * 10**9, deps=("f0",), free_bytes=6 * 10**9
    )
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
        (
            {"id": "x", "kind": "h2d", "gpu": "gpu0", "bytes": 1, "alloc_bytes": -5},
            "'x' has negative alloc_bytes",
        ),
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
    cycle = _graph(
        {**a, "deps": ["c"]},
        {**a, "id": "b", "deps": ["a"]},
        {**a, "id": "c", "deps": ["b"]},
        {**a, "id": "d", "deps": ["c"]},
    )
    rotations = "a -> b -> c -> a|b -> c -> a -> b|c -> a -> b -> c"
    with pytest.raises(PipeswapError, match=f"dependency cycle: ({rotations})"):
        TaskGraph.from_json(cycle)


def test_wrong_format_is_refused() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.graph/1"):
        TaskGraph.from_json({"format": "pipeswap.profile/1", "tasks": []})


def test_memory_gpus_follow_the_documented_rule() -> None:
    assert Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1).memory_gpus == ("gpu0",)
    assert Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1, gpu="gpu1").memory_gpus == ("gpu1",)
    assert Task("t", "allreduce", gpus=("gpu0", "gpu1"), bytes=1).memory_gpus == ("gpu0", "gpu1")
    with pytest.raises(PipeswapError, match="neither src nor dst"):
        Task("t", "p2p", src="gpu0", dst="gpu1", bytes=1, gpu="gpu2")


_D2H = {"id": "x", "kind": "d2h", "gpu": "gpu0", "bytes": 1}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"id": None}, "task None: 'id' must be a non-empty string, found None"),
        ({"id": 7}, "task 7: 'id' must be a non-empty string"),
        ({"id": ""}, "task '': 'id' must be a non-empty string"),
        ({"kind": []}, "task 'x': 'kind' must be a string \\(compute, "),
        ({"gpu": 1.5}, "task 'x': 'gpu' must be a GPU name \\(a string\\), found 1.5"),
        ({"gpus": "gpu0"}, "task 'x': 'gpus' must be a list of GPU names"),
        ({"gpus": {}}, "task 'x': 'gpus' must be a list of GPU names .*found \\{\\}"),
        ({"deps": [None]}, "task 'x': 'deps' must be a list of task ids"),
        ({"deps": None}, "task 'x': 'deps' must be a list of task ids"),
        ({"duration_s": "1"}, "task 'x': duration_s must be a number of seconds, found '1'"),
        ({"duration_s": float("nan")}, "task 'x' has duration_s nan; use a finite value"),
        ({"duration_s": float("inf")}, "task 'x' has duration_s inf; use a finite value"),
        ({"duration_s": 10**400}, "task 'x': duration_s is 1000"),
        ({"bytes": 1e300}, "task 'x': bytes must be at most 2\\*\\*63 - 1 bytes, found 1e\\+300"),
        ({"bytes": 10**400}, "task 'x': bytes must be at most 2\\*\\*63 - 1 bytes"),
        ({"bytes": float("inf")}, "task 'x': bytes must be a whole number of bytes, found inf"),
        ({"alloc_bytes": float("nan")}, "task 'x': alloc_bytes must be a whole number"),
        ({"free_bytes": True}, "task 'x': free_bytes must be a number of bytes, found True"),
        ({"free_bytes": -1}, "task 'x' has negative free_bytes"),
    ],
)
def test_wrong_types_and_ranges_are_refused_naming_the_task_and_field(
    change: dict, message: str
) -> None:
    with pytest.raises(PipeswapError, match=message):
        TaskGraph.from_json(_graph({**_D2H, **change}))


def test_a_graph_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(PipeswapError, match="expected a pipeswap.graph/1 JSON object, found list"):
        TaskGraph.from_json([])  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match="'tasks' must be a list"):
        TaskGraph.from_json({"format": "pipeswap.graph/1", "tasks": {}})


def test_damaged_graphs_are_loaded_or_refused_with_a_pipeswap_error(contract_graph, mutate) -> None:
    rng = random.Random(20240611)
    outcomes = {"loaded": 0, "refused": 0}
    for attempt in range(200):
        damaged = contract_graph
        for _ in range(rng.choice((1, 1, 2, 3))):  # mostly one change, sometimes a few
            damaged = mutate(damaged, rng)
        try:
            graph = TaskGraph.from_json(damaged)
        except PipeswapError as exc:
            assert str(exc), f"attempt {attempt}: an empty message for {damaged!r}"
            outcomes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
            pytest.fail(f"attempt {attempt}: {type(exc).__name__}: {exc} for {damaged!r}")
        else:
            # What loads is what the JSON says, with the types the contract promises.
            for task, obj in zip(graph.tasks, damaged["tasks"], strict=True):
                assert task.id == obj["id"] and task.kind == obj["kind"], attempt
                names = [task.id, task.kind, *task.gpus, *task.deps]
                names += [n for n in (task.gpu, task.src, task.dst) if n is not None]
                assert all(isinstance(n, str) and n for n in names), attempt
                assert 0 <= task.duration_s < math.inf, attempt
                for size in (task.bytes, task.alloc_bytes, task.free_bytes):
                    assert type(size) is int and 0 <= size < 2**63, attempt
            assert TaskGraph.from_json(graph.to_json()) == graph
            outcomes["loaded"] += 1
    assert outcomes["refused"] > 50 and outcomes["loaded"] > 10, outcomes


def test_a_misspelt_key_is_refused_naming_the_one_meant() -> None:
    import pytest

    from pipeswap.errors import PipeswapError

    task = {"id": "b", "kind": "compute", "gpu": "gpu0", "duraton_s": 5.0}
    with pytest.raises(PipeswapError, match="task 'b': unknown key 'duraton_s'; did you mean"):
        Task.from_json(task)


def test_a_duration_whose_sums_would_overflow_is_refused() -> None:
    import pytest

    from pipeswap.errors import PipeswapError

    with pytest.raises(PipeswapError, match="duration_s 1e[+]308; use at most 1e[+]09 s"):
        TaskGraph((Task(id="a", kind="compute", gpu="gpu0", duration_s=1e308),))
