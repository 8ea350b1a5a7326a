"""pipeswap.Pipeline's checkpoints: every stage's state at a step boundary, and back."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeswap.checkpoint import (
    CheckpointPlan,
    check_identity,
    latest_complete,
    load_rank,
    step_dir,
)
from pipeswap.config_fields import require
from pipeswap.dist.group import barrier, broadcast_from_rank0, rank_and_world
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.stage_restore import restore_stage
from pipeswap.training.resume import run_identity

__all__ = ["Checkpoint", "identity", "newest_checkpoint", "save_stages"]


# pipe.step takes batches of any shape: the first one's is no setting of the run's.
_ANY_SHAPE = frozenset({"batch", "seq_len", "image_size"})


def identity(executor: StageExecutor, world: int) -> dict[str, Any]:
    """What a checkpoint of this pipeline must agree on to be continued by another (not
    the shape of the first batch: a run goes on with batches of any shape)."""
    config = executor.config
    pipeline = config.require_pipeline()
    found = run_identity(
        config,
        world,
        api="pipeswap.Pipeline",
        schedule=pipeline.schedule,
        weights=pipeline.weights,
        balance=list(pipeline.stage_balance),
        micro_batches=pipeline.micro_batch_count,
    )
    return {key: value for key, value in found.items() if key not in _ANY_SHAPE}


def save_stages(
    executor: StageExecutor, directory: str | os.PathLike[str], done: int, world: int
) -> None:
    """This rank's stage after ``done`` steps into ``directory`` (every rank calls it, at a
    step boundary of a synchronous schedule); complete on every rank when it returns."""
    plan = CheckpointPlan(
        str(directory),
        0,
        identity(executor, world),
        world,
        run_id=broadcast_from_rank0(os.urandom(8).hex(), world),
    )
    executor.save(plan, done)
    if world > 1:
        barrier()


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint set :func:`save_stages` wrote: where, after how many steps."""

    directory: str
    done: int
    manifest: dict[str, Any]

    def restore(self, executor: StageExecutor, world: int) -> None:
        """Continue ``executor`` (this rank's stage) from its file, refused when the set
        was written by a pipeline of other settings."""
        where = str(step_dir(self.directory, self.done))
        theirs = self.manifest.get("identity", {})
        manifest = {
            **self.manifest,
            "identity": {key: value for key, value in theirs.items() if key not in _ANY_SHAPE},
        }
        check_identity(manifest, identity(executor, world), where)
        rank, _ = rank_and_world()
        restore_stage(executor, load_rank(self.directory, self.done, rank))


def newest_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint:
    found = latest_complete(directory)
    require(
        found is not None,
        f"{directory}: no complete checkpoint there; give a directory pipe.save wrote",
    )
    assert found is not None
    return Checkpoint(str(directory), *found)
