"""measure_rank in two gloo ranks: every measurement is there, positive and finite."""

from __future__ import annotations

import math

import pytest

from pipeswap.dist.calibrate import measure_rank
from pipeswap.dist.launch import spawn

pytestmark = pytest.mark.dist


def test_every_rank_measures_copies_collectives_and_compute() -> None:
    launched = spawn(measure_rank, 2, True, timeout_s=120)
    assert launched.ok, launched.messages
    first, second = launched.results
    assert first["backend"] == "gloo" and first["device"] == "cpu"
    for kind in ("h2d-pageable", "d2h-pageable", "both-pageable"):
        assert first["copy"][kind]["alone"] > 0 and second["copy"][kind]["alone"] is None
        assert all(r["copy"][kind]["together"] > 0 for r in launched.results)
    assert first["compute"]["alone"] > 0 and second["compute"]["together"] > 0
    for rank in launched.results:
        for key in ("allreduce", "p2p"):
            sizes = [size for size, _ in rank[key]]
            assert sizes == sorted(sizes) and len(sizes) >= 2
            assert all(math.isfinite(s) and s > 0 for _, s in rank[key])
