"""TrainConfig: one typed description of a training run, whatever its mode.

``pipeswap train`` parses its options into one TrainConfig; the data-parallel path and
the pipeline path both take it. ``swap`` holds the options only data parallelism uses,
``pipeline`` those only a pipeline uses; at most one of them is set, and which one is
the run's mode.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from pipeswap.errors import PipeswapError
from pipeswap.optim import DEFAULT_LR, check_optimizer

MODES = ("data-parallel", "pipeline", "emulate")


@dataclass(frozen=True)
class SwapOptions:
    """Data parallelism with swapping: the plan's policy, budget and topology."""

    policy: str = "auto"
    sync_every: int = 1
    gpu_memory_bytes: int | None = None
    footprint_ratio: float | None = None
    topology: str | None = None  # preset name, JSON file or "detect" (None: see data_parallel)
    time_limit_s: float = 60.0

    def check(self) -> None:
        from pipeswap.swap.planner import POLICIES

        if self.policy not in POLICIES:
            raise PipeswapError(
                f"unknown swap policy {self.policy!r}; valid: {', '.join(POLICIES)}"
            )
        if self.sync_every < 1:
            raise PipeswapError(f"--sync-every is {self.sync_every}; use 1 or more")
        if self.gpu_memory_bytes is not None and self.footprint_ratio is not None:
            raise PipeswapError("give --gpu-memory or --footprint-ratio, not both")
        if self.footprint_ratio is not None and not (
            math.isfinite(self.footprint_ratio) and self.footprint_ratio >= 1
        ):
            raise PipeswapError(
                f"--footprint-ratio is {self.footprint_ratio}; use a number of 1 or more "
                "(1.5: the budget is two thirds of the no-swap peak)"
            )
        if not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0):
            raise PipeswapError(f"--time-limit is {self.time_limit_s}; use a positive number")


@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline parallelism: stages, schedule, weight versions, and one-process emulation."""

    stages: int
    balance: tuple[int, ...] | None = None  # layers per stage (None: the partitioner's)
    schedule: str = "1f1b"
    weights: str = "stale"
    distances: str = "schedule"
    lr_warmup: int = 0
    micro_batches: int | None = None  # None: K for gpipe/1f1b, 1 for async-1f1b
    eval_batches: int = 2
    memory_cap_bytes: int | None = None
    emulate: bool = False
    error_feedback: bool = False

    def check(self) -> None:
        if self.stages < 1:
            raise PipeswapError(f"--pipeline is {self.stages}; cut the model into 1 or more stages")
        if self.eval_batches < 0:
            raise PipeswapError(f"--eval-batches is {self.eval_batches}; use 0 or more")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise PipeswapError(f"--micro-batches is {self.micro_batches}; use 1 or more")
        if self.lr_warmup < 0:
            raise PipeswapError(
                f"--lr-warmup must be 0 (no warm-up) or a number of steps, not {self.lr_warmup}"
            )

    @property
    def micro_batch_count(self) -> int:
        if self.micro_batches is not None:
            return self.micro_batches
        return 1 if self.schedule == "async-1f1b" else self.stages


@dataclass(frozen=True)
class TrainConfig:
    """One training run. ``None`` fields take their defaults in :meth:`resolved`.

    ``model`` is a zoo name or ``package.module:function`` (pipelines). ``batch`` is the
    mini-batch of one rank (data parallel: the micro-batch of one rank; pipeline: the
    mini-batch the stages split into micro-batches). ``seed`` seeds both the initial
    weights and the data order. ``device`` defaults to CUDA when available for data
    parallelism and to the CPU for pipelines.
    """

    model: str
    batch: int | None = None
    seq_len: int | None = None
    image_size: int | None = None
    steps: int = 20
    seed: int = 0
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str | None = None
    nproc: int | None = None
    timeout_s: float = 60.0
    profile_path: str | None = None
    swap: SwapOptions | None = None
    pipeline: PipelineOptions | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    progress: bool = field(default=True, compare=False)

    @property
    def mode(self) -> str:
        """``data-parallel``, ``pipeline`` (one process per stage) or ``emulate``."""
        if self.pipeline is None:
            return "data-parallel"
        return "emulate" if self.pipeline.emulate else "pipeline"

    @property
    def swap_options(self) -> SwapOptions:
        return self.swap or SwapOptions()

    def check(self) -> None:
        """Refuse values no mode can train with, naming the option and what to write."""
        if self.swap is not None and self.pipeline is not None:
            raise PipeswapError(
                "--swap-policy applies to data-parallel training; drop --pipeline to swap, or "
                "drop --swap-policy to train a pipeline"
            )
        check_optimizer(self.optimizer)
        for name, value in (
            ("--batch", self.batch),
            ("--seq-len", self.seq_len),
            ("--image-size", self.image_size),
        ):
            if value is not None and value < 1:
                raise PipeswapError(f"{name} is {value}; use 1 or more")
        if self.steps < 1:
            raise PipeswapError(f"--steps must be at least 1, not {self.steps}")
        if not 0 <= self.seed < 2**63:
            raise PipeswapError(f"--seed is {self.seed}; use a whole number in [0, 2**63)")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise PipeswapError(f"--lr is {self.lr}; use a positive number such as 0.05")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise PipeswapError(f"--momentum is {self.momentum}; use a number in [0, 1)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise PipeswapError(f"--weight-decay is {self.weight_decay}; use 0 or more")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise PipeswapError(f"--timeout is {self.timeout_s}; use a positive number of seconds")
        if self.nproc is not None and self.nproc < 1:
            raise PipeswapError(f"--nproc is {self.nproc}; use 1 or more")
        if self.device not in (None, "cpu", "cuda"):
            raise PipeswapError(f"unknown device {self.device!r}; use cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise PipeswapError("--device cuda, but PyTorch sees no GPU here; use --device cpu")
        if self.checkpoint_every < 0:
            raise PipeswapError(
                f"--checkpoint-every is {self.checkpoint_every}; use a number of steps (0: only "
                "when stopped by SIGTERM)"
            )
        if self.checkpoint_every and self.checkpoint_dir is None and self.resume is None:
            raise PipeswapError("--checkpoint-every needs --checkpoint-dir DIR to write into")
        if self.swap is not None:
            self.swap.check()
        if self.pipeline is not None:
            self.pipeline.check()
            if self.nproc is not None and self.nproc != self.pipeline.stages:
                raise PipeswapError(
                    f"--nproc {self.nproc} does not match --pipeline {self.pipeline.stages}: "
                    "one rank per stage"
                )
            if self.pipeline.emulate and self.nproc is not None:
                raise PipeswapError(
                    "--emulate runs every stage in this process: drop --nproc, or drop "
                    "--emulate to run one process per stage"
                )

    def resolved(self) -> TrainConfig:
        """This config with every default filled in (zoo shapes, learning rate, device)."""
        self.check()
        batch, seq_len, image_size = self.batch, self.seq_len, self.image_size
        from pipeswap.models import model_spec, shape_defaults

        spec = model_spec(self.model)
        if spec.task == "lm" and image_size is not None:
            raise PipeswapError(
                f"{self.model} is a language model: pass --seq-len, not --image-size"
            )
        if spec.task == "classify" and seq_len is not None:
            raise PipeswapError(f"{self.model} is an image model: pass --image-size, not --seq-len")
        seq_len, image_size = shape_defaults(self.model, seq_len, image_size)
        batch = batch or spec.default_batch
        device = self.device
        if device is None:
            device = "cuda" if self.pipeline is None and torch.cuda.is_available() else "cpu"
        return replace(
            self,
            batch=batch or 8,
            seq_len=seq_len,
            image_size=image_size,
            lr=DEFAULT_LR[self.optimizer] if self.lr is None else self.lr,
            device=device,
            swap=SwapOptions() if self.pipeline is None and self.swap is None else self.swap,
        )

    @property
    def checkpoint_target(self) -> str | None:
        """Where this run writes checkpoints: --checkpoint-dir, else the --resume folder when
        --checkpoint-every asks for more."""
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        return self.resume if self.checkpoint_every else None

    def identity(self, world_size: int, **extra: Any) -> dict[str, Any]:
        """What a checkpoint of this run must agree on to be resumed by another one."""
        from pipeswap import __version__

        return {
            "pipeswap": __version__,
            "mode": "data-parallel" if self.pipeline is None else "pipeline",
            "model": self.model,
            "world_size": world_size,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "image_size": self.image_size,
            "seed": self.seed,
            "steps": self.steps,
            "optimizer": self.optimizer,
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            **extra,
        }

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj.pop("progress")
        obj["mode"] = self.mode
        if self.pipeline is not None and self.pipeline.balance is not None:
            obj["pipeline"]["balance"] = list(self.pipeline.balance)
        return obj
