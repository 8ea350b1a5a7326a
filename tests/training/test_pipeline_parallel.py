"""A pipeline run's prediction: on the topology it is given, slowed as calibrated.

Covers: pipeswap/training/pipeline_parallel.py (predicted_step_s; the runs themselves are in
tests/commands/test_train_cli.py and tests/pipeline).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeswap.hardware.calibration import Calibration
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.profiling.measure import measure
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training import pipeline_parallel, pipeline_stage_swaps


def _machine(
    path: Path,
    transfer_slowdown: float,
    ranks: int = 2,
    allreduce_latency_s: float = 0.0,
    stage_slowdown: float = 1.0,
) -> str:
    # Transfers all but free, so the two predictions differ by the compute alone.
    calibration = Calibration(
        ranks=ranks,
        device="cpu",
        backend="gloo",
        copy_bytes_per_s={"h2d-pageable": (1e12, 1e12)},
        allreduce=(allreduce_latency_s, 1e15),
        p2p=(0.0, 1e15),
        compute_slowdown=1.0,
        date="2026-11-26",
        command="pipeswap topology calibrate --nproc 2",
        transfer_slowdown=transfer_slowdown,
        stage_slowdown=stage_slowdown,
    )
    calibration.topology(f"calibrated-cpu-{ranks}", 1 << 30).save(path)
    return str(path)


def _two_stages() -> TrainConfig:
    """gpt2-micro in 2 stages of 2 micro-batches of 2 samples, resolved."""
    config = TrainConfig(
        "gpt2-micro", batch=4, seq_len=16, steps=3, device="cpu", pipeline=PipelineConfig(stages=2)
    )
    return resolve_pipeline(config)


def test_a_pipeline_predicts_on_the_topology_it_is_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _two_stages()
    fixed = measure("gpt2-micro", 2, seq_len=16)  # the micro-batch's size: 4 in 2
    seen: list[int] = []

    def measured(model: object, batch: int, **kwargs: object) -> object:
        seen.append(batch)
        return fixed

    monkeypatch.setattr(pipeline_stage_swaps, "measure", measured)
    same = pipeline_parallel.predicted_step_s(
        replace(config, topology=_machine(tmp_path / "a.json", 1.0))
    )
    slowed = pipeline_parallel.predicted_step_s(
        replace(config, topology=_machine(tmp_path / "b.json", 2.0))
    )
    both = _machine(tmp_path / "c.json", 1.5, stage_slowdown=2.0)
    assert pipeline_parallel.predicted_step_s(replace(config, topology=both)) == pytest.approx(
        3 * same
    )
    assert seen == [2, 2, 2]
    # Every action's compute (and each stage's share of the optimizer step) doubles.
    assert slowed == pytest.approx(2 * same, rel=1e-6)
    assert same > fixed.compute_s  # the schedule's fill and drain on top of the compute


def test_a_replicated_pipeline_predicts_its_replicas_and_their_averaging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _two_stages()
    two = resolve_pipeline(replace(one, nproc=4))
    assert two.require_pipeline().replicas == 2
    fixed = measure("gpt2-micro", 2, seq_len=16)
    monkeypatch.setattr(pipeline_stage_swaps, "measure", lambda *a, **k: fixed)
    alone = pipeline_parallel.predicted_step_s(
        replace(one, topology=_machine(tmp_path / "a.json", 1.0))
    )
    free = _machine(tmp_path / "b.json", 1.0, ranks=4)
    slow = _machine(tmp_path / "c.json", 1.0, ranks=4, allreduce_latency_s=1.0)
    # Identical replicas and a free exchange: one pipeline's step.
    assert pipeline_parallel.predicted_step_s(replace(two, topology=free)) == pytest.approx(alone)
    # Each step's update waits for its stage's exchange (1 s): at least 1 s more a step.
    assert pipeline_parallel.predicted_step_s(replace(two, topology=slow)) >= alone + 1.0
