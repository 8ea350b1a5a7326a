"""The outcome of a pipeline run, assembled from every stage's report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeswap.dist.digest import combine_digests
from pipeswap.errors import PipeswapError
from pipeswap.models.tasks import task_kind
from pipeswap.pipeline.stage_result import StageResult
from pipeswap.pipeline.step_end import step_loss
from pipeswap.schedule.timetable import TimedAction
from pipeswap.train_config import TrainConfig

__all__ = ["NOTES", "PipelineResult", "combine", "pipeline_summary"]


@dataclass(frozen=True)
class PipelineResult:
    """Losses per step, held-out score, throughput, stage busy fractions and final hashes.

    ``params_sha256`` is :func:`pipeswap.dist.digest.params_sha256` of the whole model:
    every rank digests only its own parameters and the digests are combined by name.
    ``mode`` is ``pipeline`` (one process per stage) or ``emulate``. ``prediction_error`` (emulator only) gives, per
    stage, ||W_used - W_future|| / ||W_now - W_future|| for forward and backward passes
    (None where the live weights were never stale, i.e. s = 0 for every pass).
    """

    config: TrainConfig
    mode: str
    losses: tuple[float, ...]
    eval: dict[str, float | int]
    samples_per_s: float
    wall_s: float
    stage_busy_s: tuple[float, ...]
    stage_sha256: tuple[str, ...]
    params_sha256: str
    distances: tuple[tuple[int, int], ...]
    prediction_error: tuple[dict[str, float | None], ...] | None
    timeline: tuple[TimedAction, ...] = ()
    evals: tuple[dict[str, float | int], ...] = ()  # every eval_every steps: {"step", **eval}
    # The simulator's step for this run (pipeswap.training.pipeline_parallel), processes only.
    predicted_step_s: float | None = None
    # Stages that swap: the plan (pipeswap.training.pipeline_stage_swaps) and, per rank in rank
    # order, what its swapper measured.
    stage_swap: dict[str, Any] | None = None
    stage_memory: tuple[dict[str, Any] | None, ...] = ()
    # Per rank in rank order: the most its device held over the first steps, by the
    # device's own meter (pipeswap.pipeline.stage_meter); -1 where none was metered.
    peak_resident_bytes: tuple[int, ...] = ()
    # The steps a checkpoint it resumed from had done (outside ``wall_s``).
    resumed_steps: int = 0

    @property
    def measured_step_s(self) -> float:
        """The run's wall time per step it ran (its fill and drain included, as predicted)."""
        return self.wall_s / max(1, self.config.steps - self.resumed_steps)

    @property
    def stage_busy(self) -> tuple[float, ...]:
        """Fraction of the training wall time each stage spent computing."""
        return tuple(b / self.wall_s if self.wall_s > 0 else 0.0 for b in self.stage_busy_s)

    def to_report(self) -> dict[str, Any]:
        """The pipeline keys of a ``pipeswap.train/2`` report (pipeswap.training.report)."""
        report: dict[str, Any] = {
            "mode": self.mode,
            "config": pipeline_summary(self.config),
            "losses": list(self.losses),
            "eval": self.eval,
            "evals": list(self.evals),
            "samples_per_s": self.samples_per_s,
            "wall_s": self.wall_s,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "stage_busy": list(self.stage_busy),
            "stage_busy_s": list(self.stage_busy_s),
            "params_sha256": self.params_sha256,
            "stage_sha256": list(self.stage_sha256),
            "version_distances": [
                {"stage": k, "forward": f, "backward": b} for k, (f, b) in enumerate(self.distances)
            ],
            "peak_resident_bytes": list(self.peak_resident_bytes),
            "notes": dict(NOTES),
        }
        if self.stage_swap is not None:
            peaks = self.peak_resident_bytes or (-1,) * len(self.stage_memory)
            measured = [
                None if m is None else {**m, "peak_resident_bytes": peak}
                for m, peak in zip(self.stage_memory, peaks, strict=True)
            ]
            report["stage_swap"] = {**self.stage_swap, "measured": measured}
        if self.prediction_error is not None:
            report["prediction_error"] = [
                {"stage": k, **err} for k, err in enumerate(self.prediction_error)
            ]
        return report


# What the pipeline keys that need it mean, written into every report.
NOTES = {
    "peak_resident_bytes": "per rank in rank order, what the device's own meter read over "
    "the stage's first steps (until its units in flight filled, then one step more, the "
    "optimizer's state included; held-out scores and checkpoints left out); compare with "
    "stage_swap.budget_bytes and stage_swap.stages[k].planned_peak_bytes (also under "
    "stage_swap.measured): CUDA: torch.cuda.max_memory_allocated from the stage's first "
    "action on; CPU: the live storages (as torch's MemTracker counts them) that the stage "
    "holds, a message counted on the stage it is sent to, the host pool left out; "
    "stage_swap.measured[rank].peak_saved_bytes is the swapper's ledger of saved tensors",
}


def pipeline_summary(config: TrainConfig) -> dict[str, Any]:
    """The ``config`` key of a pipeline report: the run's settings in one flat object."""
    pipeline, optimizer = config.require_pipeline(), config.optim
    return {
        "model": config.model,
        "balance": list(pipeline.stage_balance),
        "schedule": pipeline.schedule,
        "weights": pipeline.weights,
        "optimizer": optimizer.name,
        "lr": optimizer.base_lr,
        "momentum": optimizer.momentum,
        "weight_decay": optimizer.weight_decay,
        "batch": config.batch,
        "micro_batches": pipeline.micro_batch_count,
        "replicas": pipeline.replicas,
        "steps": config.steps,
        "seq_len": config.seq_len,
        "image_size": config.image_size,
        "seed": config.seed,
        "eval_batches": config.dataset.eval_batches,
        "distances": pipeline.distances,
        "lr_warmup": optimizer.warmup,
        "lr_schedule": optimizer.schedule,
    }


def combine(
    config: TrainConfig,
    stages: Sequence[StageResult],
    *,
    mode: str,
    task: str,
    wall_s: float,
    resumed: int = 0,
) -> PipelineResult:
    """One result from the per-stage results, in stage order (replica by replica for a
    replicated pipeline: a step's loss is then the replicas' mean, in replica order, and
    every replica must end with replica 0's weights). ``wall_s`` is the time of the steps
    after the ``resumed`` a checkpoint had done."""
    pipeline = config.require_pipeline()
    n, m = pipeline.num_stages, pipeline.micro_batch_count
    replicas = [stages[first : first + n] for first in range(0, len(stages), n)]
    memory = tuple(s.memory for s in stages)
    peaks = tuple(s.peak_resident_bytes for s in stages)
    stages = replicas[0]
    last = stages[-1]
    per_replica = [
        [step_loss(replica[-1].losses, step, m) for step in range(config.steps)]
        for replica in replicas
    ]
    losses = tuple(sum(values) / len(values) for values in zip(*per_replica, strict=True))
    for d, replica in enumerate(replicas[1:], start=1):
        for k, (mine, first) in enumerate(zip(replica, stages, strict=True)):
            if mine.sha256 != first.sha256:
                raise PipeswapError(
                    f"stage {k} of replica {d} ended with other weights than replica 0's: the "
                    "replicas' gradient averaging failed; please report this with the command"
                )
    evaluation = last.held_out.score(config.dataset.eval_batches, classify=task_kind(task).accuracy)
    digests = tuple(s.sha256 for s in stages)
    errors = tuple(s.prediction_error for s in stages)
    samples = (config.steps - resumed) * (config.batch or 0) * len(replicas)
    return PipelineResult(
        config=config,
        mode=mode,
        losses=losses,
        eval=evaluation,
        evals=tuple({"step": step, **score} for step, score in last.evals),
        samples_per_s=samples / wall_s if wall_s > 0 else 0.0,
        wall_s=wall_s,
        stage_busy_s=tuple(s.busy_s for s in stages),
        stage_sha256=digests,
        params_sha256=combine_digests({k: v for s in stages for k, v in s.param_digests.items()}),
        distances=tuple(s.distances for s in stages),
        prediction_error=None if any(e is None for e in errors) else errors,  # type: ignore[arg-type]
        timeline=tuple(t for s in stages for t in s.timeline),
        stage_memory=memory if any(m is not None for m in memory) else (),
        peak_resident_bytes=peaks,
        resumed_steps=resumed,
    )
