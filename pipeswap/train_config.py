"""TrainConfig: one training run, whatever its mode, composed of its components' configs.

The run's own fields (model, batch shape, steps, seed, where it runs) sit at the top;
``optim``, ``swap``, ``pipeline``, ``checkpoint`` and ``dataset`` are the configs of the
components that own them (each declares, defaults and checks its fields once).
``pipeline`` says the mode: data parallelism with swapping (None, the default) or a
pipeline; ``swap`` says how data parallelism swaps, and on a pipeline how its stages
swap (None: they keep everything; pipeswap.training.pipeline_stage_swaps). Checks that need two components (a weight mode
and its optimizer, a memory cap and a profile) live here; checks that need the model
(its layers, its default shapes) run when the run is resolved (pipeswap.training.resolve).
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, asdict, dataclass, field, replace
from typing import Any

from pipeswap.checkpoint import CheckpointConfig, latest_complete, split_step_dir
from pipeswap.config_fields import option, require
from pipeswap.data_config import DataConfig
from pipeswap.metrics import LogConfig
from pipeswap.optim import OptimizerConfig
from pipeswap.precision import DEFAULT_PRECISION, PRECISIONS, check_precision
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig

__all__ = ["DEVICES", "TrainConfig"]

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TrainConfig:
    """One training run (``model`` positional, the rest by keyword). ``model`` is a zoo name, a local Hugging Face directory or
    ``package.module:function`` returning an nn.Module.

    ``batch`` is the mini-batch of one rank (data parallel: each rank's micro-batch;
    pipeline: the mini-batch the stages split into micro-batches); None takes the model's
    default, as do ``seq_len`` and ``image_size``. ``seed`` seeds the initial weights, the
    data order and dropout. ``device`` None: CUDA when available for data parallelism,
    the CPU for pipelines.
    """

    model: str = option(
        help="zoo model name (e.g. gpt2-tiny), a local Hugging Face model directory, or "
        "module:function returning an nn.Module"
    )
    _: KW_ONLY
    batch: int | None = option(None, help="mini-batch per rank (default: the model's)")
    seq_len: int | None = option(None, help="tokens per sequence (language models)")
    image_size: int | None = option(None, help="image side in pixels (image models)")
    steps: int = option(20, help="optimizer steps")
    seed: int = option(0, help="seed of the initial weights, the data order and dropout")
    device: str | None = option(
        None,
        choices=DEVICES,
        help="where to train: cpu uses gloo, cuda NCCL (gloo when ranks share a GPU); "
        "default cuda when available for data parallelism, cpu for pipelines",
    )
    precision: str = option(
        DEFAULT_PRECISION,
        choices=PRECISIONS,
        help="fp32, or mixed precision through torch.autocast: bf16-mixed, fp16-mixed (with "
        "a dynamic loss scale; data parallelism only); weights stay float32",
    )
    nproc: int | None = option(
        None, help="start this many local ranks (a pipeline: one per stage of each replica)"
    )
    timeout_s: float = option(60.0, help="seconds a rank waits for a peer before failing")
    topology: str | None = option(
        None,
        metavar="NAME|FILE|detect",
        help="GPUs and PCIe links to plan and predict for: a preset, a topology JSON file "
        "(pipeswap topology calibrate writes one) or detect (default: this machine's kept "
        "calibration, else detected on CUDA, else preset switch-4)",
    )
    profile_path: str | None = option(
        None,
        metavar="PATH",
        help="a profile JSON: data parallelism plans from it (default: measure here); a "
        "pipeline balances its stages with it (default: FLOP counts)",
    )
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    swap: SwapConfig | None = None
    pipeline: PipelineConfig | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dataset: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)
    progress: bool = field(default=True, compare=False)

    def __post_init__(self) -> None:
        for name, value in (
            ("batch", self.batch),
            ("seq_len", self.seq_len),
            ("image_size", self.image_size),
            ("nproc", self.nproc),
        ):
            require(value is None or value >= 1, f"{{{name}}} is {value}; use 1 or more")
        require(self.steps >= 1, f"{{steps}} must be at least 1, not {self.steps}")
        require(
            0 <= self.seed < 2**63, f"{{seed}} is {self.seed}; use a whole number in [0, 2**63)"
        )
        require(
            math.isfinite(self.timeout_s) and self.timeout_s > 0,
            f"{{timeout_s}} is {self.timeout_s}; use a positive number of seconds",
        )
        require(
            self.device in (None, *DEVICES),
            f"unknown {{device}} {self.device!r}; use cpu or cuda",
        )
        check_precision(self.precision)
        require(
            not self.checkpoint.checkpoint_every
            or self.checkpoint.checkpoint_dir is not None
            or self.checkpoint.resume is not None,
            "{checkpoint_every} needs {checkpoint_dir} DIR to write into",
        )
        if self.pipeline is not None:
            self._check_pipeline(self.pipeline)

    def _check_pipeline(self, pipeline: PipelineConfig) -> None:
        stages = pipeline.num_stages
        require(
            self.nproc is None
            or self.nproc == pipeline.num_ranks
            or (pipeline.replicas == 1 and self.nproc % stages == 0),
            f"{{nproc}} {self.nproc} does not match {{stages}} {stages}"
            + (f" x {{replicas}} {pipeline.replicas}" if pipeline.replicas > 1 else "")
            + f": one rank per stage of each replica (a multiple of {stages})",
        )
        require(
            not (pipeline.emulate and self.nproc is not None),
            "{emulate} runs every stage in this process: drop {nproc}, or drop {emulate} to "
            "run one process per stage",
        )
        require(
            pipeline.memory_cap_bytes is None or self.profile_path is not None,
            "{memory_cap_bytes} needs {profile_path} (a measured or estimated profile)",
        )
        require(
            self.optim.accumulate == 1 or pipeline.schedule_kind.takes_micro_batches,
            f"{{accumulate}} {self.optim.accumulate}: {{schedule}} {pipeline.schedule} "
            "pipelines whole mini-batches and updates after each, so there is nothing to "
            "accumulate between updates; raise {batch} instead, or use {schedule} 1f1b, "
            "gpipe or 2bw",
        )
        require(
            self.precision != "fp16-mixed",
            "{precision} fp16-mixed is not available for pipelines: its loss scale must skip "
            "the same steps on every stage, and stages update at different times; use "
            "{precision} bf16-mixed (no loss scale needed), or train data parallel",
        )
        # What the weight mode needs of the optimizer, as its table entry says.
        weight_mode(pipeline.weights).check_optimizer(self.optim)

    @property
    def mode(self) -> str:
        """``data-parallel``, ``pipeline`` (one process per stage) or ``emulate``."""
        if self.pipeline is None:
            return "data-parallel"
        return "emulate" if self.pipeline.emulate else "pipeline"

    def require_pipeline(self) -> PipelineConfig:
        """The pipeline settings of a pipeline run."""
        require(self.pipeline is not None, "this run is not a pipeline: set {pipeline}")
        assert self.pipeline is not None
        return self.pipeline

    def require_swap(self) -> SwapConfig:
        """The swap settings of a data-parallel run (the defaults when none were given)."""
        require(self.pipeline is None, "this run is a pipeline: its stages swap by {swap}")
        return self.swap or SwapConfig()

    def resolved(self) -> TrainConfig:
        """This config with the model's defaults filled in: batch, sequence length or image
        size, the device, and the swap settings of a data-parallel run (a pipeline keeps
        the ones it was given: none, its stages keep everything). Idempotent."""
        # The zoo (and torch) load when a run is resolved, not when a config is declared.
        import torch

        from pipeswap.models.registry import model_spec, shape_defaults

        spec = model_spec(self.model)
        spec.task_entry.check_sizes(
            self.model, self.seq_len, self.image_size, tokens=bool(spec.reads_tokens)
        )
        self._check_data_for(spec.encoder_decoder)
        require(
            self.device != "cuda" or torch.cuda.is_available(),
            "{device} cuda, but PyTorch sees no GPU here; use {device} cpu",
        )
        seq_len, image_size = shape_defaults(self.model, self.seq_len, self.image_size)
        # The optimizer by the model's task (unless given, or a resumed checkpoint's),
        # one the weight mode runs with.
        mode = None if self.pipeline is None else weight_mode(self.pipeline.weights)
        optim = _resumed_optimizer(self.optim, self.checkpoint.resume).filled(
            spec.task, self.steps, fits=None if mode is None else mode.fits
        )
        device = self.device
        if device is None:
            device = "cuda" if self.pipeline is None and torch.cuda.is_available() else "cpu"
        return replace(
            self,
            batch=self.batch or spec.default_batch or 8,
            seq_len=seq_len,
            image_size=image_size,
            device=device,
            optim=optim,
            swap=self.require_swap() if self.pipeline is None else self.swap,
        )

    def _check_data_for(self, encoder_decoder: bool) -> None:
        """An encoder-decoder trains data-parallel on source/target pairs; the fields of
        pairs apply to nothing else."""
        if not encoder_decoder:
            require(
                self.dataset.source_field is None,
                f"{{source_field}} and {{target_field}} are for encoder-decoder models (T5, "
                f"BART); {self.model} is a language model of one stack, which trains on "
                "{data}'s {text_field}: drop them",
            )
            return
        require(
            self.pipeline is None,
            f"{self.model} is an encoder-decoder model, which pipelines cannot cut yet (its "
            "decoder reads the encoder's output at every block): drop {pipeline} to train "
            "it data-parallel with swapping, or use pipeswap.offload in your own loop",
        )
        require(
            self.dataset.source_field is not None,
            f"{self.model} is an encoder-decoder model: it trains on source/target pairs; "
            "give {data} FILE (.jsonl, .csv or .parquet) with {source_field} and "
            "{target_field} naming its fields",
        )
        require(
            self.profile_path is None,
            f"{{profile_path}}: {self.model} is an encoder-decoder model, profiled in the run "
            "itself; drop {profile_path}",
        )

    @property
    def micro_batch_size(self) -> int:
        """Samples per pipeline unit: the mini-batch split into the schedule's micro-batches."""
        assert self.batch is not None
        return self.batch // self.require_pipeline().micro_batch_count

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        obj.pop("progress")
        obj["mode"] = self.mode
        if self.pipeline is not None and self.pipeline.balance is not None:
            obj["pipeline"]["balance"] = list(self.pipeline.balance)
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> TrainConfig:
        """The config :meth:`to_json` wrote."""
        values = {k: v for k, v in obj.items() if k != "mode"}
        optim, swap = dict(values.get("optim", {})), values.get("swap")
        if swap is not None and "sync_every" in swap:  # written before it was accumulate
            swap = dict(swap)
            optim["accumulate"] = swap.pop("sync_every")
        if swap is not None and "topology" in swap:  # written before both modes used it
            swap = dict(swap)
            values["topology"] = swap.pop("topology")
        pipeline = values.get("pipeline")
        if pipeline is not None and pipeline.get("balance") is not None:
            pipeline = {**pipeline, "balance": tuple(pipeline["balance"])}
        return cls(
            **{
                **values,
                "optim": OptimizerConfig(**optim),
                "swap": None if swap is None else SwapConfig(**swap),
                "pipeline": None if pipeline is None else PipelineConfig(**pipeline),
                "checkpoint": CheckpointConfig(**values.get("checkpoint", {})),
                "dataset": DataConfig(**values.get("dataset", {})),
                "log": LogConfig(**values.get("log", {})),
            }
        )


def _resumed_optimizer(optim: OptimizerConfig, resume: str | None) -> OptimizerConfig:
    """``optim`` with what it leaves to the task taken from the checkpoint it resumes.

    A checkpoint keeps the optimizer it was trained with when resumed without naming one:
    one written when every model defaulted to SGD at 0.05 goes on with it, instead of
    being refused because language models now default to AdamW. Settings the user gives
    still win (and a checkpoint that disagrees with them is refused, naming the first).
    No checkpoint there: the task's defaults (the resume itself then says what is wrong).
    """
    if resume is None or optim.optimizer is not None:
        return optim
    found = latest_complete(*split_step_dir(resume))
    recorded = {} if found is None else found[1].get("identity", {})
    if recorded.get("optimizer") is None:
        return optim
    return replace(
        optim,
        optimizer=recorded["optimizer"],
        lr=recorded.get("lr") if optim.lr is None else optim.lr,
        lr_warmup=recorded.get("lr_warmup", 0) if optim.lr_warmup is None else optim.lr_warmup,
        lr_schedule=(
            recorded.get("lr_schedule", "constant")
            if optim.lr_schedule is None
            else optim.lr_schedule
        ),
    )
