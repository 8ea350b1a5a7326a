"""A run's checkpoint plan and the checkpoint it resumes from, checked against its identity."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pipeswap.checkpoint import (
    CheckpointPlan,
    check_identity,
    latest_complete,
    split_step_dir,
    step_dir,
)
from pipeswap.config_fields import leaf_fields, require
from pipeswap.dist.group import broadcast_from_rank0
from pipeswap.models.load import same_model_directory
from pipeswap.models.registry import model_names
from pipeswap.train_config import TrainConfig
from pipeswap.user_files import fingerprint
from pipeswap.version import __version__

__all__ = ["agree_on_run", "checkpointing", "identity_fields", "run_identity"]


def checkpointing(
    config: TrainConfig, world_size: int, **extra: Any
) -> tuple[CheckpointPlan | None, tuple[str, int] | None]:
    """Where this run checkpoints (None: nowhere) and (directory, steps done) to resume from.

    ``extra`` adds mode-specific fields to the identity a checkpoint must match.
    """
    identity = run_identity(config, world_size, **extra)
    settings = config.checkpoint
    resume = None
    if settings.resume is not None:
        root, step = split_step_dir(settings.resume)  # a step folder: that step
        found = latest_complete(root, step)
        require(
            found is not None,
            f"{{resume}} {settings.resume}: no complete checkpoint there (a step folder whose "
            "manifest and rank files all exist); drop {resume} to start afresh",
        )
        assert found is not None
        done, manifest = found
        theirs = manifest.get("identity", {}).get("steps")
        require(
            "steps" not in identity or theirs in (None, config.steps),
            f"{{resume}} {settings.resume} is a run of {theirs} steps on the asynchronous "
            f"schedule {config.pipeline.schedule if config.pipeline else ''}, whose last steps "
            f"drain the pipeline: it continues only with {{steps}} {theirs}; start afresh "
            "for a longer run (synchronous schedules and data parallelism continue for more "
            "steps)",
        )
        where = f"the checkpoint {step_dir(root, done)}"
        require(
            done <= config.steps,
            f"{{resume}} {settings.resume} has done {done} steps, more than this run's "
            f"{{steps}} {config.steps}: give {{steps}} {done} or more to continue it, or "
            "start afresh",
        )
        recorded = manifest.get("identity", {})
        # Checkpoints written before a key was recorded are compared on the rest.
        compared = {k: v for k, v in identity.items() if k in recorded or k not in _LATER}
        if same_model_directory(str(recorded.get("model")), config.model, model_names()):
            compared["model"] = recorded["model"]  # the same directory, named another way
        check_identity(manifest, compared, where, identity_fields(identity))
        resume = (root, done)
    target = settings.target
    plan = None
    if target is not None:
        plan = CheckpointPlan(target, settings.every, identity, world_size)
    return plan, resume


def agree_on_run(plan: CheckpointPlan | None, world_size: int) -> CheckpointPlan | None:
    """``plan`` with rank 0's run id, so every rank stamps its files with the same run.

    (Under torchrun each process made its own plan; spawned ranks got the launcher's.)
    """
    if plan is None:
        return None
    return replace(plan, run_id=broadcast_from_rank0(plan.run_id, world_size))


# Identity keys recorded since a version of pipeswap whose checkpoints lack them.
_LATER = frozenset({"clip_grad_norm", "data", "eval_data"})
# Identity keys that are not the name of the config field that sets them.
_SET_BY = {"world_size": "nproc", "sync_every": "accumulate"}


def identity_fields(identity: dict[str, Any]) -> dict[str, str]:
    """The config field that sets each key of ``identity`` (those a config sets), so a
    refusal names it as the caller does (a flag on the command line)."""
    names = {f.name for _, f in leaf_fields(TrainConfig)}
    found = {key: _SET_BY.get(key, key) for key in identity}
    return {key: name for key, name in found.items() if name in names}


def run_identity(config: TrainConfig, world_size: int, **extra: Any) -> dict[str, Any]:
    """What a checkpoint of this run must agree on to be resumed by another one."""
    optimizer = config.optim
    identity = {
        "pipeswap": __version__,
        "mode": "data-parallel" if config.pipeline is None else "pipeline",
        "model": config.model,
        "world_size": world_size,
        "batch": config.batch,
        "seq_len": config.seq_len,
        "image_size": config.image_size,
        "seed": config.seed,
        "precision": config.precision,
        "optimizer": optimizer.name,
        "lr": optimizer.base_lr,
        "momentum": optimizer.momentum,
        "weight_decay": optimizer.weight_decay,
        "lr_warmup": optimizer.warmup,
        "lr_schedule": optimizer.schedule,
        "lr_decay_steps": optimizer.lr_decay_steps,
        "clip_grad_norm": optimizer.clip_grad_norm,
        # What the run read: a resume on other data (or changed files) is refused.
        "data": None if config.dataset.data is None else fingerprint(config.dataset.data),
        "eval_data": (
            None if config.dataset.eval_data is None else fingerprint(config.dataset.eval_data)
        ),
        **extra,
    }
    if config.pipeline is not None and config.pipeline.asynchronous:
        # An asynchronous schedule's actions depend on the whole horizon (it flushes only
        # at the end): a checkpoint resumes only the run of its own length. Elsewhere a
        # finished run continues for more steps exactly as a longer run would have gone on.
        identity["steps"] = config.steps
    return identity
