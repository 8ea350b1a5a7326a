"""What a pipeline run trains and how: the config every rank and the emulator share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel
from pipeswap.optim import check_optimizer
from pipeswap.pipeline.predict import DISTANCE_RULES
from pipeswap.pipeline.schedule import SCHEDULE_NAMES

WEIGHT_MODES = ("stale", "stash", "spectrain", "predict-adam", "nesterov")

# Schedules with no pipeline flush, whose stages take delayed gradients.
_DELAYED_SCHEDULES = ("async-1f1b", "2bw")


@dataclass(frozen=True)
class PipelineConfig:
    """One pipeline training run; identical on every rank so every rank builds the same model.

    ``model`` is a zoo name (``gpt2-tiny``) or ``"package.module:function"`` returning a
    LayeredModel (the function is called with the global RNG seeded by ``seed``).
    ``balance[k]`` is the number of layers of stage k. ``batch`` is the mini-batch size;
    synchronous schedules split it into ``micro_batches`` equal units.
    ``distances`` picks the version distances of ``spectrain`` / ``predict-adam``: walked
    from the schedule, or the official SpecTrain table (see pipeswap.pipeline.predict).
    ``lr_warmup`` ramps every stage's learning rate linearly over the first that many
    mini-batches (update of mini-batch t uses ``lr * min(1, (t + 1) / lr_warmup)``), the
    same in every schedule and weight mode; 0 is a constant rate.
    ``weights="nesterov"`` is the Nesterov method of Ajanthan et al. (arXiv 2505.01099) as
    released: weight stashing plus NAdam with ``beta1 = momentum`` (see
    pipeswap.pipeline.weights); it needs ``optimizer`` adam or adamw.
    ``error_feedback`` asks for the Error-Feedback correction of Zmushko et al. (arXiv
    2606.30634); it is refused for now (see :meth:`check`).
    """

    model: str
    balance: tuple[int, ...]
    schedule: str = "1f1b"
    weights: str = "stale"
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    batch: int = 8
    micro_batches: int = 1
    steps: int = 10
    seq_len: int | None = None
    image_size: int | None = None
    seed: int = 0
    data_seed: int = 0
    eval_batches: int = 2
    timeout_s: float = 60.0
    distances: str = "schedule"
    lr_warmup: int = 0
    error_feedback: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.balance)

    @property
    def micro_batch_size(self) -> int:
        return self.batch // self.micro_batches

    def check(self) -> None:
        """Refuse combinations that cannot run, naming what to use instead."""
        if self.schedule not in SCHEDULE_NAMES:
            raise PipeswapError(
                f"unknown schedule {self.schedule!r}; valid: {', '.join(SCHEDULE_NAMES)}"
            )
        if self.weights not in WEIGHT_MODES:
            raise PipeswapError(
                f"unknown weight mode {self.weights!r}; valid: {', '.join(WEIGHT_MODES)}"
            )
        check_optimizer(self.optimizer)
        if self.batch < 1 or self.micro_batches < 1 or self.batch % self.micro_batches:
            raise PipeswapError(
                f"--batch {self.batch} must split into --micro-batches {self.micro_batches} "
                f"equal parts: pick a batch that is a multiple of the micro-batch count"
            )
        if self.distances not in DISTANCE_RULES:
            raise PipeswapError(
                f"unknown distance rule {self.distances!r}; valid: {', '.join(DISTANCE_RULES)}"
            )
        if self.lr_warmup < 0:
            raise PipeswapError(
                f"--lr-warmup must be 0 (no warm-up) or a number of steps, not {self.lr_warmup}"
            )
        if self.steps < 1:
            raise PipeswapError(f"--steps must be at least 1, not {self.steps}")
        if self.weights == "spectrain" and (self.optimizer != "sgd" or self.momentum <= 0):
            raise PipeswapError(
                f"--weights spectrain predicts with the SGD momentum buffer, but "
                f"--optimizer {self.optimizer} --momentum {self.momentum} has none: use "
                f"--optimizer sgd --momentum 0.9, or --weights predict-adam with --optimizer "
                f"adam or adamw"
            )
        if self.weights == "nesterov" and self.optimizer not in ("adam", "adamw"):
            raise PipeswapError(
                f"--weights nesterov is the method of Ajanthan et al. (arXiv 2505.01099) as its "
                f"authors released it: NAdam with weight stashing. Only that Adam-family "
                f"variant is defined (their code has no SGD variant), so --optimizer "
                f"{self.optimizer} cannot run it: use --optimizer adamw (NAdamW, as released) "
                f"or --optimizer adam"
            )
        if self.weights == "nesterov" and not 0.0 <= self.momentum < 1.0:
            raise PipeswapError(
                f"--weights nesterov uses --momentum as NAdam's beta1, which must lie in "
                f"[0, 1), not {self.momentum}: the authors run --momentum 0.99"
            )
        if self.error_feedback and self.schedule not in _DELAYED_SCHEDULES:
            raise PipeswapError(
                f"--error-feedback corrects delayed gradients, but --schedule {self.schedule} "
                f"is synchronous (every gradient is applied to the weights it was taken at): "
                f"use --schedule async-1f1b, or drop --error-feedback"
            )
        if self.error_feedback:
            raise PipeswapError(
                "--error-feedback is not available yet: the correction formula of Zmushko et "
                "al. (arXiv 2606.30634, Section 3) could not be checked against the paper, "
                "and pipeswap does not ship a guessed version; drop --error-feedback"
            )
        if self.weights == "predict-adam" and self.optimizer not in ("adam", "adamw"):
            raise PipeswapError(
                "--weights predict-adam predicts with Adam's step direction: use --optimizer "
                "adam or adamw, or --weights spectrain for SGD with momentum"
            )

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj["balance"] = list(self.balance)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PipelineConfig:
        return cls(**{**obj, "balance": tuple(obj["balance"])})


def model_factory(name: str) -> Callable[[torch.device], LayeredModel]:
    """A function building the full model ``name`` on a device: a zoo name, a Hugging Face
    directory or ``module:function`` (pipeswap.models.load).

    It draws initial weights from the global RNG, so callers seed it first.
    """
    from pipeswap.models.load import is_user_model

    if is_user_model(name):
        from pipeswap.models import build_model as build_user_model

        return lambda device: build_user_model(name, device=device, seed=None)
    from pipeswap.models import build_model, model_spec

    model_spec(name)  # an unknown name fails here, before any model is built
    # LMs keep their tied embeddings: stages holding a tied weight share its updates
    # (pipeswap.pipeline.shared), so a pipeline trains the model data-parallel training does.
    return lambda device: build_model(name, device=device, seed=None)


def build_full_model(config: PipelineConfig, device: torch.device | str = "cpu") -> LayeredModel:
    """The whole model with weights seeded by ``config.seed`` (same on every rank).

    It is built on the CPU and then moved, so CPU and CUDA runs start from the same weights.
    """
    factory = model_factory(config.model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = factory(torch.device("cpu"))
    return model.to(device)


def build_meta_model(config: PipelineConfig) -> LayeredModel:
    """The model on the meta device (shapes only), for checks and shape inference."""
    return model_factory(config.model)(torch.device("meta"))


class BatchSource:
    """The training (or held-out) batches of a run; micro-batch ``m`` of step ``s`` on demand."""

    def __init__(self, config: PipelineConfig, model: LayeredModel, split: str = "train") -> None:
        self.config = config
        self.model = model
        self.split = split
        self._dataset = _dataset(config, model, split)
        self._cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached is None or self._cached[0] != step:
            if self._dataset is None:
                seed = (
                    self.config.data_seed * 1_000_003
                    + step
                    + (0 if self.split == "train" else 1 << 30)
                )
                pair = self.model.example_batch(
                    self.config.batch,
                    seq_len=self.config.seq_len,
                    image_size=self.config.image_size,
                    seed=seed,
                )
            else:
                pair = self._dataset.batch(self.config.batch, step)
            self._cached = (step, pair)
        return self._cached[1]

    def micro(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(step)
        size = self.config.micro_batch_size
        return inputs[index * size : (index + 1) * size], targets[index * size : (index + 1) * size]


def _dataset(config: PipelineConfig, model: LayeredModel, split: str) -> Any:
    """The zoo's offline dataset for the model, or None (random example batches) if it has none."""
    try:
        from pipeswap.data import dataset_for
    except ImportError:
        return None
    try:
        return dataset_for(
            model,
            seq_len=config.seq_len,
            image_size=config.image_size,
            split=split,
            seed=config.data_seed,
        )
    except PipeswapError:
        if ":" in config.model:
            return None
        raise
