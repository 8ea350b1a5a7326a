"""Tests of the task graph builder (pipeswap.sim.builder).

Covers: pipeswap/sim/builder.py.
"""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.graph import TaskGraph


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
