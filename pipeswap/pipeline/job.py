"""The model and the batches every stage of a pipeline run builds identically from its config."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeswap.data import dataset_for
from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel
from pipeswap.models.export import export_trained
from pipeswap.models.load import is_user_model
from pipeswap.models.registry import build_model, model_spec
from pipeswap.train_config import TrainConfig

__all__ = [
    "BatchSource",
    "build_full_model",
    "build_meta_model",
    "load_stage_tensors",
    "model_factory",
    "save_trained",
]


def model_factory(
    name: str, image_size: int | None = None
) -> Callable[[torch.device], LayeredModel]:
    """A function building the full model ``name`` on a device: a zoo name, a Hugging Face
    directory or ``module:function`` (pipeswap.models.load), for images of ``image_size``
    (image models; build_model refuses a size the model cannot take, as in data parallelism).

    It draws initial weights from the global RNG, so callers seed it first. Language
    models keep their tied embeddings: stages holding a tied weight share its updates
    (pipeswap.pipeline.shared), so a pipeline trains the model data parallelism does.
    """
    if not is_user_model(name):
        model_spec(name)  # an unknown name fails here, before any model is built
    return lambda device: build_model(name, device=device, seed=None, image_size=image_size)


def build_full_model(config: TrainConfig, device: torch.device | str = "cpu") -> LayeredModel:
    """The whole model with weights seeded by ``config.seed`` (same on every rank).

    It is built on the CPU and then moved, so CPU and CUDA runs start from the same weights.
    """
    factory = model_factory(config.model, config.image_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = factory(torch.device("cpu"))
    return model.to(device)


def save_trained(config: TrainConfig, states: Sequence[dict[str, torch.Tensor] | None]) -> None:
    """Write the trained model to ``config.checkpoint.save`` from every stage's tensors
    (named as in the whole model), in the format the model came in (models.export)."""
    if config.checkpoint.save is None:
        return
    model = build_full_model(config)
    assert all(state is not None for state in states), "a saving run's stages report tensors"
    load_stage_tensors(model, [state for state in states if state is not None])
    export_trained(model, config.checkpoint, source=config.model, steps=config.steps)


def load_stage_tensors(model: LayeredModel, states: Sequence[dict[str, torch.Tensor]]) -> None:
    """Load every stage's tensors (named as in the whole model) into ``model``, strictly:
    each tensor of the model must come from a stage (a tied weight from one of them)."""
    full = model.state_dict(keep_vars=True)
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        # Buffers the model does not persist (rotary frequencies) are no part of its weights.
        merged.update((name, tensor) for name, tensor in state.items() if name in full)
    # One tensor given under several names (the model's own buffers, held by its first
    # stage's embed and its last stage's head): the first stage's, in stage order.
    first: dict[int, str] = {}
    apart: list[str] = []
    for name in list(merged):
        earlier = first.setdefault(id(full[name]), name)
        if earlier != name:
            if not torch.equal(merged[earlier], merged[name]):
                apart.append(name.split(".", 1)[-1])
            merged[name] = merged[earlier]
    if apart:
        # The model's own buffers live on its first stage and on its last: one its forward
        # updates before the blocks is kept from the first stage, which runs that code.
        warnings.warn(
            f"{model.name}'s own {', '.join(sorted(set(apart)))} differ between the first "
            "stage and the last: its forward updates them, and each of the two stages holds "
            "a copy (the code after the blocks read the last stage's, never updated there); "
            "the first stage's are kept. Hold such state in a block, or train on one stage",
            stacklevel=2,
        )
    # A tied weight is reported under one of its names: give its aliases the same tensor.
    given = {id(tensor): name for name, tensor in full.items() if name in merged}
    for name, tensor in full.items():
        if name not in merged and id(tensor) in given:
            merged[name] = merged[given[id(tensor)]]
    missing = [name for name in model.state_dict() if name not in merged]
    if missing:  # strict: every tensor of the model came from a stage
        raise RuntimeError(f"no stage gave {', '.join(missing[:5])} of {model.name}")
    # Through .data: a stage's own tensors may be held by graphs in flight (a pipeline's
    # weights taken mid-run), whose version check an in-place load would fail.
    with torch.no_grad():
        for name, tensor in merged.items():
            full[name].data.copy_(tensor)


def build_meta_model(config: TrainConfig) -> LayeredModel:
    """The model on the meta device (shapes only), for checks and shape inference."""
    return model_factory(config.model, config.image_size)(torch.device("meta"))


class BatchSource:
    """The training (or held-out) batches of a run; micro-batch ``m`` of step ``s`` on demand.

    Replica ``replica`` of a pipeline with D replicas trains on batch ``step * D + replica``
    of the data (the batches of D steps of one pipeline, side by side, as data-parallel
    ranks read theirs); held-out batches are the same for every replica.
    """

    def __init__(
        self, config: TrainConfig, model: LayeredModel, split: str = "train", replica: int = 0
    ) -> None:
        assert config.batch is not None, "a resolved config has its batch size"
        self.config = config
        pipeline = config.pipeline
        replicas = pipeline.replicas if pipeline is not None and split == "train" else 1
        self._index = (replicas, replica if split == "train" else 0)
        self.batch_size = config.batch
        self.micro_batch_size = config.micro_batch_size
        self.model = model
        self.split = split
        self._dataset = _dataset(config, model, split)
        self._cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached is None or self._cached[0] != step:
            replicas, replica = self._index
            index = step * replicas + replica
            if self._dataset is None:
                held_out = 0 if self.split == "train" else 1 << 30
                pair = self.model.example_batch(
                    self.batch_size,
                    seq_len=self.config.seq_len,
                    image_size=self.config.image_size,
                    seed=self.config.seed * 1_000_003 + index + held_out,
                )
            else:
                pair = self._dataset.batch(self.batch_size, index)
            self._cached = (step, pair)
        return self._cached[1]

    def micro(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(step)
        size = self.micro_batch_size
        return inputs[index * size : (index + 1) * size], targets[index * size : (index + 1) * size]


def _dataset(config: TrainConfig, model: LayeredModel, split: str) -> Any:
    """The offline dataset for the model, or None (random example batches, said in a
    warning) for a module:function model no built-in data fits and no data is given."""
    try:
        return dataset_for(
            model,
            seq_len=config.seq_len,
            image_size=config.image_size,
            split=split,
            seed=config.seed,
            data=config.dataset.source(split),
        )
    except PipeswapError as exc:
        if ":" in config.model and config.dataset.data is None:
            # Said, never silent: data parallel refuses such a model outright.
            warnings.warn(
                f"{exc}; no data given, so the pipeline trains on random example batches "
                "of the model (give your own data to train on it)",
                stacklevel=2,
            )
            return None
        raise
