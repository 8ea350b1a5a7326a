"""A checkpoint of any mode as the trained model, in the format the model came in."""

from __future__ import annotations

import os
from typing import Any

import torch

from pipeswap.checkpoint import (
    CheckpointConfig,
    latest_complete,
    load_rank,
    split_step_dir,
    step_dir,
)
from pipeswap.data_config import DataConfig
from pipeswap.errors import PipeswapError
from pipeswap.models.export import check_save_target, export_model
from pipeswap.models.load import names_user_model, same_model_directory
from pipeswap.models.registry import build_model, model_names, model_spec
from pipeswap.models.seq2seq import load_seq2seq
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.job import load_stage_tensors
from pipeswap.precision import DEFAULT_PRECISION
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.run import train

__all__ = ["export_checkpoint"]


def export_checkpoint(directory: str, out: str, model: str | None = None) -> tuple[int, str]:
    """Write the model of the newest complete checkpoint in ``directory`` (or of the step
    folder it names, ``ckpt/step-00000200``: an earlier step) to ``out`` (as
    ``--save`` writes it: a Hugging Face model as its directory, any other module as
    ``model.safetensors`` of its own keys); returns (steps done, the model's name).

    A checkpoint is data: the model it names is built only if it is a zoo model or the
    caller names the same model (``model``); nothing a file names is ever imported.
    """
    if not os.path.isdir(directory):
        raise PipeswapError(
            f"{directory}: no such directory; name the checkpoint directory a training run "
            "wrote into"
        )
    named = directory  # a step folder names the step to export
    directory, step = split_step_dir(directory)
    found = latest_complete(directory, step)
    if found is None:
        raise PipeswapError(
            f"{named}: no complete checkpoint there (a step folder whose manifest and rank "
            "files all exist); name the checkpoint directory a training run wrote into, or "
            "one of its step folders"
        )
    done, manifest = found
    identity: dict[str, Any] = manifest.get("identity", {})
    recorded = identity.get("model")
    if not isinstance(recorded, str):
        raise PipeswapError(f"{directory}: its manifest names no model; it is not a pipeswap run")
    name = _model_to_build(directory, recorded, model)
    check_save_target(out, name, checkpoints=(directory,))
    # A synchronous pipeline's checkpoint resumes a run of any length; an asynchronous
    # one's only the run it came from (its identity holds the steps).
    steps = identity.get("steps", done)
    if identity.get("mode") != "data-parallel" and done == steps:
        # Resumed for no step, the stages settle the updates of tied weights still in
        # flight at the cut, and save what a --save run would.
        folder = str(step_dir(directory, done))  # this step, not the newest
        train(_finished_pipeline(folder, out, {**identity, "model": name}, steps))
        return done, name
    if model_spec(name).encoder_decoder:  # trained whole, data-parallel only
        with torch.random.fork_rng(devices=[]):
            whole = load_seq2seq(name, device="cpu")
        whole.load_state_dict(load_rank(directory, done, 0)["model"])
        export_model(whole, out, source=name, steps=done, checkpoints=(directory,))
        return done, name
    with torch.random.fork_rng(devices=[]):
        built = build_model(name, device="cpu", image_size=identity.get("image_size"))
    if identity.get("mode") == "data-parallel":
        built.load_state_dict(load_rank(directory, done, 0)["model"])
    else:
        # Replica 0's stages (every replica holds the same weights): the first files.
        stages = range(len(identity.get("balance") or ()) or int(identity["world_size"]))
        load_stage_tensors(built, [_stage_tensors(directory, done, r, identity) for r in stages])
    export_model(built, out, source=name, steps=done, checkpoints=(directory,))
    return done, name


def _model_to_build(directory: str, recorded: str, given: str | None) -> str:
    """The model name export builds: the checkpoint's own when it is a zoo name, else the
    caller's ``given`` one, which must name the model the checkpoint records.

    A manifest may be written by anyone: a ``module:function`` or a directory in it is never
    imported or read unless the user names the same model.
    """
    zoo = model_names()
    if given is None:
        if recorded in zoo and not names_user_model(recorded, zoo):  # not a directory here
            return recorded
        kind = "module:function" if ":" in recorded and not os.path.isdir(recorded) else "model"
        raise PipeswapError(
            f"{directory} was trained from the {kind} {recorded!r}, which export builds only "
            f"when you name it too (a checkpoint is data, and never makes pipeswap import or "
            f"load what it names): pass --model {recorded}"
        )
    if given == recorded or same_model_directory(given, recorded, zoo):
        # The recorded string: a pipeline's checkpoint resumes only under the same name.
        return recorded
    raise PipeswapError(
        f"{directory} was trained from {recorded!r}, not {given!r}: pass --model {recorded} "
        "(from the directory the run started in, if that is a relative path)"
    )


def _finished_pipeline(
    directory: str, out: str, identity: dict[str, Any], steps: int
) -> TrainConfig:
    """The emulated run of ``steps`` that resumes a pipeline's checkpoint (the step folder
    ``directory``) after its last step and saves."""
    return TrainConfig(
        identity["model"],
        batch=identity["batch"],
        seq_len=identity["seq_len"],
        image_size=identity["image_size"],
        seed=identity["seed"],
        steps=steps,
        precision=identity.get("precision", DEFAULT_PRECISION),
        optim=OptimizerConfig(
            optimizer=identity["optimizer"],
            lr=identity["lr"],
            momentum=identity["momentum"],
            weight_decay=identity["weight_decay"],
            lr_warmup=identity["lr_warmup"],
            lr_schedule=identity.get("lr_schedule", "constant"),
            lr_decay_steps=identity.get("lr_decay_steps"),
        ),
        pipeline=PipelineConfig(
            balance=tuple(identity["balance"]),
            schedule=identity["schedule"],
            weights=identity["weights"],
            distances=identity["distances"],
            micro_batches=identity["micro_batches"],
            replicas=int(identity.get("replicas", 1)),
            emulate=True,
        ),
        checkpoint=CheckpointConfig(resume=directory, save=out),
        dataset=DataConfig(eval_batches=0),
        progress=False,
    )


def _stage_tensors(
    directory: str, done: int, rank: int, identity: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """One pipeline stage's weights and buffers, by their names in the whole model."""
    state = load_rank(directory, done, rank)
    if state.get("tied"):
        raise PipeswapError(
            f"{directory}: the checkpoint after step {done} holds updates of tied weights "
            "that the stages apply after it, so no stage has their value yet; resume the run "
            "to its end with --save DIR, or export its final checkpoint"
        )
    if "names" not in state:
        raise PipeswapError(
            f"{directory}: stage {rank}'s checkpoint was written by pipeswap "
            f"{identity.get('pipeswap')}, which did not record its weights' names; resume the "
            "run with this version for a step to write one that exports"
        )
    return {**dict(zip(state["names"], state["weights"]["params"])), **state["buffers"]}
