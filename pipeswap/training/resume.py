"""A run's checkpoint plan and the checkpoint it resumes from, checked against its identity."""

from __future__ import annotations

from typing import Any

from pipeswap.checkpoint import CheckpointPlan, check_identity, latest_complete, step_dir
from pipeswap.errors import PipeswapError
from pipeswap.training.config import TrainConfig


def checkpointing(
    config: TrainConfig, world_size: int, **extra: Any
) -> tuple[CheckpointPlan | None, tuple[str, int] | None]:
    """Where this run checkpoints (None: nowhere) and (directory, steps done) to resume from.

    ``extra`` adds mode-specific fields to the identity a checkpoint must match.
    """
    identity = config.identity(world_size, **extra)
    resume = None
    if config.resume is not None:
        found = latest_complete(config.resume)
        if found is None:
            raise PipeswapError(
                f"--resume {config.resume}: no complete checkpoint there (a step folder whose "
                "manifest and rank files all exist); drop --resume to start afresh"
            )
        done, manifest = found
        check_identity(manifest, identity, f"the checkpoint {step_dir(config.resume, done)}")
        resume = (config.resume, done)
    target = config.checkpoint_target
    plan = None
    if target is not None:
        plan = CheckpointPlan(target, config.checkpoint_every, identity, world_size)
    return plan, resume
