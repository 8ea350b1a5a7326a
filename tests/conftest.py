"""Fixtures shared across test folders."""

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _no_calibration_of_this_machine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A calibration the developer made (pipeswap topology calibrate) must not change what
    tests plan and predict: they see an empty PIPESWAP_HOME (ranks they start too)."""
    import os

    previous = os.environ.get("PIPESWAP_HOME")
    os.environ["PIPESWAP_HOME"] = str(tmp_path_factory.mktemp("pipeswap-home"))
    yield
    if previous is None:
        os.environ.pop("PIPESWAP_HOME", None)
    else:
        os.environ["PIPESWAP_HOME"] = previous


# The task-graph example of design.md, exactly as written there.
_CONTRACT_GRAPH = {
    "format": "pipeswap.graph/1",
    "tasks": [
        {
            "id": "f0",
            "kind": "compute",
            "gpu": "gpu0",
            "duration_s": 1.0,
            "alloc_bytes": 8000000000,
        },
        {
            "id": "out0",
            "kind": "d2h",
            "gpu": "gpu0",
            "bytes": 6000000000,
            "deps": ["f0"],
            "free_bytes": 6000000000,
        },
        {
            "id": "in0",
            "kind": "h2d",
            "gpu": "gpu0",
            "bytes": 6000000000,
            "deps": ["out0"],
            "alloc_bytes": 6000000000,
        },
        {"id": "act", "kind": "p2p", "src": "gpu0", "dst": "gpu1", "bytes": 1000000000},
        {
            "id": "grads",
            "kind": "allreduce",
            "gpus": ["gpu0", "gpu1"],
            "bytes": 4000000000,
            "deps": ["in0", "act"],
        },
    ],
}


@pytest.fixture
def contract_graph() -> dict[str, Any]:
    """design.md's pipeswap.graph/1 example (a fresh copy per test)."""
    return copy.deepcopy(_CONTRACT_GRAPH)


# ---- fuzzing loaders --------------------------------------------------------------------
Mutate = Callable[[object, random.Random], object]
_MUTANTS: list[object] = [-1, 0, 1.5, 1e300, math.nan, "x", None, [], {}]


def _mutate(obj: object, rng: random.Random) -> object:
    """A copy of ``obj`` with one random leaf replaced or one random key deleted."""
    obj = copy.deepcopy(obj)
    slots: list[tuple[Any, Any]] = []  # every (container, key), so any depth can be hit
    stack = [obj]
    while stack:
        here: Any = stack.pop()
        pairs = here.items() if isinstance(here, dict) else enumerate(here)
        for key, value in pairs:
            slots.append((here, key))
            if isinstance(value, dict | list):
                stack.append(value)
    container, key = rng.choice(slots)
    if isinstance(container, dict) and rng.random() < 0.25:
        del container[key]
    else:
        container[key] = rng.choice(_MUTANTS)
    return obj


@pytest.fixture
def mutate() -> Mutate:
    """Damage a JSON document at random (seeded by the caller's ``random.Random``)."""
    return _mutate


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """One intra-op thread for the module: its runs are compared bit for bit, and one
    thread keeps float reductions in one order whatever the machine's core count (and
    ranks it starts do not oversubscribe the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
