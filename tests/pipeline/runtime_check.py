"""Run pipeline configs in real gloo ranks and check each against the emulator, bit for bit."""

from __future__ import annotations

from typing import Any

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.dist.launch import spawn
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.runtime import run_stage_rank
from pipeswap.train_config import TrainConfig


def train_checkpointed(
    rank: int,
    world: int,
    config: TrainConfig,
    plan: CheckpointPlan | None,
    resume: tuple[str, int] | None,
) -> tuple[tuple[float, ...], str] | None:
    """One rank of ``config`` checkpointing by ``plan`` or resuming; rank 0's (losses, digest)."""
    result = run_stage_rank(config, checkpoint=plan, resume=resume)
    return None if result is None else (result.losses, result.params_sha256)


def run_all(rank: int, world: int, configs: list[TrainConfig]) -> list[dict[str, Any] | None]:
    """Every config in turn on this rank; rank 0's reports (None elsewhere)."""
    out = []
    for config in configs:
        result = run_stage_rank(config)
        out.append(None if result is None else result.to_report())
    return out


def assert_runtime_matches_emulator(configs: list[TrainConfig], nproc: int) -> list[dict[str, Any]]:
    """Losses, held-out score and every digest equal; returns the runtime's reports."""
    launched = spawn(run_all, nproc, configs, timeout_s=60)
    assert launched.ok, launched.exit_codes
    reports: list[dict[str, Any]] = launched.results[0]
    for config, runtime in zip(configs, reports, strict=True):
        emulated = Emulator(config).run().to_report()
        assert runtime["mode"] == "pipeline" and emulated["mode"] == "emulate"
        pipeline = config.require_pipeline()
        label = (
            f"{pipeline.schedule}/{pipeline.weights}/{config.optim.optimizer}/{pipeline.num_stages}"
        )
        for key in ("losses", "eval", "evals", "stage_sha256", "params_sha256"):
            assert runtime[key] == emulated[key], (label, key)
    return reports
