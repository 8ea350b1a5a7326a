"""train(config): run a TrainConfig in its mode and return its ``pipeswap.train/2`` report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeswap.pipeline.validate import TimedAction
from pipeswap.training.config import TrainConfig


@dataclass(frozen=True)
class TrainOutcome:
    """What rank 0 (or the one process) learns from a run: its report and, for pipelines,
    the timeline of every stage's passes (for a Chrome trace)."""

    config: TrainConfig
    report: dict[str, Any]
    timeline: tuple[TimedAction, ...] = field(default=(), repr=False)


def train(config: TrainConfig) -> TrainOutcome | None:
    """Train ``config`` in its mode; the outcome on rank 0, None on torchrun's other ranks.

    Example (one process, data parallel without swapping)::

        from pipeswap import TrainConfig, train
        outcome = train(TrainConfig("gpt2-micro", batch=4, seq_len=16, steps=3))
        print(outcome.report["losses"], outcome.report["params_sha256"])
    """
    resolved = config.resolved()
    if resolved.pipeline is None:
        from pipeswap.training.data_parallel import train_data_parallel

        report = train_data_parallel(resolved)
        return None if report is None else TrainOutcome(resolved, report)
    from pipeswap.training import pipelined

    result = pipelined.run_pipeline(resolved)
    if result is None:
        return None
    return TrainOutcome(resolved, pipelined.report(resolved, result), result.timeline)
