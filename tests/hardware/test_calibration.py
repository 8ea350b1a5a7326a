"""A calibration's fits are the closed forms, and its topology carries what was measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.calibration import (
    Calibration,
    calibrated_path,
    fit_latency_bandwidth,
    found_calibration,
)
from pipeswap.hardware.topology import GB, Topology


def test_the_fit_recovers_latency_and_bandwidth_exactly() -> None:
    points = [(size, 1e-4 + size / 2e9) for size in (4096, 65536, 1 << 20, 16 << 20)]
    latency, bandwidth = fit_latency_bandwidth(points)
    assert latency == pytest.approx(1e-4, rel=1e-9)
    assert bandwidth == pytest.approx(2e9, rel=1e-9)
    # A negative intercept (noise at small sizes) is refitted through the origin.
    assert fit_latency_bandwidth([(1e6, 1e-3), (2e6, 2.2e-3)])[0] == 0.0
    # Larger sizes no slower (noise): the fastest rate seen.
    assert fit_latency_bandwidth([(1e3, 1e-3), (1e6, 1e-3)]) == (0.0, 1e9)
    with pytest.raises(PipeswapError, match="2 sizes"):
        fit_latency_bandwidth([(1.0, 1.0)])


def _rank(rank: int, copy_together: float, compute_together: float) -> dict[str, Any]:
    sizes = [4096, 1 << 20]
    return {
        "rank": rank,
        "device": "cpu",
        "backend": "gloo",
        "copy": {
            "h2d-pageable": {"alone": 8e9 if rank == 0 else None, "together": copy_together},
            "both-pageable": {"alone": 9e9 if rank == 0 else None, "together": copy_together},
        },
        "compute": {
            "alone": 0.01 if rank == 0 else None,
            "together": compute_together,
            "with_p2p": 1.2 + rank / 10,
            "one_thread": {"alone": 0.01 if rank == 0 else None, "together": 0.02 + rank / 100},
        },
        "allreduce": [[s, 2e-4 + s / 1e9] for s in sizes],  # bus bytes = s (2 ranks)
        "p2p": [[s, 5e-5 + s / 4e9] for s in sizes],
    }


def test_ranks_measurements_become_one_calibration_and_a_topology(tmp_path: Path) -> None:
    measured = [_rank(0, 5e9, 0.018), _rank(1, 4e9, 0.02)]
    calibration = Calibration.from_ranks(measured, date="2026-11-26", command="pipeswap x")
    assert calibration.copy_bytes_per_s["h2d-pageable"] == (8e9, 4e9)  # the slowest rank
    assert calibration.compute_slowdown == pytest.approx(2.0)
    assert calibration.transfer_slowdown == pytest.approx(1.3)  # the slowest rank
    assert calibration.stage_slowdown == pytest.approx(3.0)  # 0.03 s together, 0.01 alone
    assert calibration.allreduce == pytest.approx((2e-4, 1e9))
    assert calibration.p2p == pytest.approx((5e-5, 4e9))
    topology = calibration.topology("calibrated-cpu-2", 1 << 30)
    assert topology.gpus == ["gpu0", "gpu1"]
    assert all(link.gb_per_s == pytest.approx(4e9 / GB) for link in topology.links)
    # Both directions at once moved 4 GB/s in all, 2 each: half of one direction alone.
    assert topology.links[0].duplex_efficiency == pytest.approx(0.5)
    topology.save(tmp_path / "t.json")
    loaded = Topology.load(tmp_path / "t.json")
    assert loaded == topology and loaded.calibration == calibration.to_json()
    assert loaded.calibration is not None and loaded.calibration["measured"] is True


def test_a_kept_calibration_that_cannot_be_read_names_the_way_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Hostile input round 4: a corrupt kept calibration broke every later run, unnamed."""
    monkeypatch.setenv("PIPESWAP_HOME", str(tmp_path))
    assert found_calibration("cpu", 2) is None  # none kept: plan on a preset
    calibrated_path("cpu", 2).write_text('{"format": "pipeswap.topology/1", "nodes": 7}')
    with pytest.raises(
        PipeswapError,
        match=r"calibrated-cpu-2\.json cannot be read .*"
        r"make it again \(pipeswap topology calibrate.*or delete the file",
    ):
        found_calibration("cpu", 2)
