"""Fixtures shared across test folders."""

import copy
from typing import Any

import pytest

# The task-graph example of design.md, exactly as written there.
_CONTRACT_GRAPH = {
    "format": "pipeswap.graph/1",
    "tasks": [
        {"id": "f0", "kind": "compute", "gpu": "gpu0", "duration_s": 1.0,
         "alloc_bytes": 8000000000},
        {"id": "out0", "kind": "d2h", "gpu": "gpu0", "bytes": 6000000000, "deps": ["f0"],
         "free_bytes": 6000000000},
        {"id": "in0", "kind": "h2d", "gpu": "gpu0", "bytes": 6000000000, "deps": ["out0"],
         "alloc_bytes": 6000000000},
        {"id": "act", "kind": "p2p", "src": "gpu0", "dst": "gpu1", "bytes": 1000000000},
        {"id": "grads", "kind": "allreduce", "gpus": ["gpu0", "gpu1"], "bytes": 4000000000,
         "deps": ["in0", "act"]},
    ],
}  # fmt: skip


@pytest.fixture
def contract_graph() -> dict[str, Any]:
    """design.md's pipeswap.graph/1 example (a fresh copy per test)."""
    return copy.deepcopy(_CONTRACT_GRAPH)
