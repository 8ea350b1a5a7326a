"""train(config): run a TrainConfig in its mode and return its ``pipeswap.train/2`` report."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import torch

from pipeswap.checkpoint import hold_directory
from pipeswap.config_fields import require
from pipeswap.dist.env import torchrun_env
from pipeswap.models.export import check_save_target, load_saved
from pipeswap.schedule.timetable import TimedAction
from pipeswap.train_config import TrainConfig
from pipeswap.training.data_parallel import train_data_parallel
from pipeswap.training.job import check_user_data
from pipeswap.training.pipeline_parallel import report as pipeline_report
from pipeswap.training.pipeline_parallel import run_pipeline
from pipeswap.training.ranks import check_ranks
from pipeswap.training.report import TrainReport

__all__ = ["TrainOutcome", "TrainingStopped", "train"]


@dataclass(frozen=True)
class TrainOutcome:
    """What rank 0 (or the one process) learns from a run: its report and, for pipelines,
    the timeline of every stage's passes (for a Chrome trace)."""

    config: TrainConfig
    report: TrainReport
    timeline: tuple[TimedAction, ...] = field(default=(), repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights by the model's own names, read back from what the run saved
        (``CheckpointConfig.save``): what ``load_state_dict`` of the model you brought
        takes (a tied weight once, as ``save_pretrained`` stores it)."""
        save = self.config.checkpoint.save
        require(
            save is not None,
            "the trained weights come back through the run's {save} directory: give {save} "
            "DIR (or turn a checkpoint into a model with `pipeswap export`)",
        )
        assert save is not None
        return load_saved(save)


def train(config: TrainConfig) -> TrainOutcome | None:
    """Train ``config`` in its mode; the outcome on rank 0, None on torchrun's other ranks.

    A data-parallel run stopped by SIGTERM or Ctrl-C ends after its step (and its
    checkpoint, with one) and raises :class:`TrainingStopped`, a KeyboardInterrupt whose
    ``outcome`` reports the steps done.

    Example (one process, data parallel without swapping)::

        from pipeswap import TrainConfig, train
        outcome = train(TrainConfig("gpt2-micro", batch=4, seq_len=16, steps=3))
        print(outcome.report.losses, outcome.report.params_sha256)
    """
    resolved = config.resolved()
    env = torchrun_env()
    launcher = env is None or env.rank == 0  # one process holds the checkpoint directory
    checkpoint = resolved.checkpoint
    if launcher and checkpoint.save is not None:
        # Before hours of training: a place that can be written and holds nothing of the user's.
        check_save_target(checkpoint.save, resolved.model, checkpoints=checkpoint.directories)
    if launcher:
        resolved.log.check_available()  # an optional package it needs, before any rank starts
        check_ranks(resolved)  # before any process starts or any replica is built
        check_user_data(resolved)
    with hold_directory(resolved.checkpoint.target if launcher else None):
        outcome = _train(resolved)
    if outcome is not None and outcome.report.stopped_by is not None:
        raise TrainingStopped(outcome)
    return outcome


class TrainingStopped(KeyboardInterrupt):
    """A signal stopped the run after a step; ``outcome`` reports the steps done (its
    ``report.stopped_by`` names the signal). A KeyboardInterrupt, as Ctrl-C in a script
    stays one."""

    def __init__(self, outcome: TrainOutcome) -> None:
        stopped_by = outcome.report.stopped_by
        assert stopped_by is not None
        super().__init__(f"stopped by {stopped_by} after step {len(outcome.report.losses)}")
        self.outcome = outcome
        self.signum = int(signal.Signals[stopped_by])


def _train(resolved: TrainConfig) -> TrainOutcome | None:
    if resolved.pipeline is None:
        report = train_data_parallel(resolved)
        return None if report is None else TrainOutcome(resolved, report)
    result = run_pipeline(resolved)
    if result is None:
        return None
    return TrainOutcome(result.config, pipeline_report(result), result.timeline)
