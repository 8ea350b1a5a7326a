"""The training report, ``pipeswap.train/2``: one typed report in every mode, written atomically.

Every report has ``format``, ``mode`` (``data-parallel``, ``pipeline`` or ``emulate``),
``model``, ``steps``, ``losses`` (one per optimizer step), ``params_sha256`` (the digest
of :func:`pipeswap.dist.digest.params_sha256`, the same definition in every mode), the
run's shape and optimizer, and ``train_config``; then the keys of its mode
(:class:`DataParallelDetails` or :class:`PipelineDetails`), at the top level of the JSON.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format, dump_json, load_json
from pipeswap.precision import DEFAULT_PRECISION
from pipeswap.train_config import TrainConfig

__all__ = [
    "OLD_FORMATS",
    "REPORT_FORMAT",
    "DataParallelDetails",
    "PipelineDetails",
    "TrainReport",
    "details_from_json",
    "load_report",
    "write_report",
]

REPORT_FORMAT = "pipeswap.train/2"
# What pipeswap 0.1 wrote, before one report served every mode.
OLD_FORMATS = {
    "pipeswap.swaptrain/1": "data-parallel",
    "pipeswap.train-report/1": "pipeline",
}


@dataclass(frozen=True, kw_only=True)
class DataParallelDetails:
    """What a data-parallel run reports beyond the common keys (per-rank lists in rank order)."""

    policy: str
    sync_every: int
    losses_per_rank: list[list[float]]
    step_s: list[list[float]]
    params_sha256_per_rank: list[str]
    buffers_sha256: str
    peak_resident_bytes: list[int]
    peak_saved_bytes: list[int]
    budget_bytes: int
    saved_budget_bytes: list[int]
    swapped_bytes: list[int]
    recompute: list[list[str]]
    recomputed_layers: list[int]
    recomputed_bytes: list[int]
    late_fetches: list[int]
    offset_s: list[float]
    predicted_step_s: float
    measured_step_s: float
    lower_bound_s: float
    topology: str
    gpus: list[str]
    dtype: str
    plan: dict[str, Any]
    notes: dict[str, str]
    eval: dict[str, float | int] | None = None  # as a pipeline's: batches, loss, accuracy


@dataclass(frozen=True, kw_only=True)
class PipelineDetails:
    """What a pipeline run reports beyond the common keys (pipeswap.pipeline.result)."""

    config: dict[str, Any]
    eval: dict[str, float | int]
    samples_per_s: float
    wall_s: float
    stage_busy: list[float]
    stage_busy_s: list[float]
    stage_sha256: list[str]
    version_distances: list[dict[str, int]]
    prediction_error: list[dict[str, Any]] | None = None
    measured_step_s: float | None = None
    predicted_step_s: float | None = None
    # Stages that swap: the plan per stage and what each rank's swapper measured.
    stage_swap: dict[str, Any] | None = None
    # Per rank: the device's own meter over the first steps (-1: not metered); reports
    # written before it have none.
    peak_resident_bytes: list[int] | None = None
    notes: dict[str, str] | None = None  # what the keys that need it mean


@dataclass(frozen=True, kw_only=True)
class TrainReport:
    """One run's report; ``data_parallel`` or ``pipeline`` holds the keys of its mode."""

    mode: str
    model: str
    steps: int
    losses: list[float]
    params_sha256: str
    batch: int | None
    seq_len: int | None
    image_size: int | None
    seed: int
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    device: str | None
    nproc: int
    train_config: dict[str, Any]
    precision: str = DEFAULT_PRECISION  # reports written before precisions existed: fp32
    # The held-out scores taken every eval_every steps: {"step": steps done, **eval}.
    evals: list[dict[str, Any]] = field(default_factory=list)
    data_parallel: DataParallelDetails | None = None
    pipeline: PipelineDetails | None = None
    # The signal (SIGTERM, SIGINT) that stopped the run after len(losses) of its steps.
    stopped_by: str | None = None
    # Whether predicted_step_s simulated this machine's calibration (pipeswap topology
    # calibrate); false: it has no basis here. None: no prediction, or an older report.
    calibrated: bool | None = None

    @classmethod
    def of(
        cls,
        config: TrainConfig,
        *,
        losses: Sequence[float],
        params_sha256: str,
        nproc: int,
        evals: Sequence[dict[str, Any]] = (),
        data_parallel: DataParallelDetails | None = None,
        pipeline: PipelineDetails | None = None,
        stopped_by: str | None = None,
        calibrated: bool | None = None,
    ) -> TrainReport:
        """The report of a run of the resolved ``config``, from what it measured."""
        optim = config.optim
        return cls(
            mode=config.mode,
            model=config.model,
            steps=config.steps,
            losses=[float(x) for x in losses],
            params_sha256=params_sha256,
            batch=config.batch,
            seq_len=config.seq_len,
            image_size=config.image_size,
            seed=config.seed,
            optimizer=optim.name,
            lr=optim.base_lr,
            momentum=optim.momentum,
            weight_decay=optim.weight_decay,
            device=config.device,
            nproc=nproc,
            train_config=config.to_json(),
            precision=config.precision,
            evals=list(evals),
            data_parallel=data_parallel,
            pipeline=pipeline,
            stopped_by=stopped_by,
            calibrated=calibrated,
        )

    def to_json(self) -> dict[str, Any]:
        """The report as JSON: the common keys, then its mode's keys at the same level."""
        out: dict[str, Any] = {"format": REPORT_FORMAT}
        for f in dataclasses.fields(self):
            if f.name not in ("data_parallel", "pipeline"):
                out[f.name] = getattr(self, f.name)
        details = self.data_parallel or self.pipeline
        if details is not None:
            out.update((k, v) for k, v in dataclasses.asdict(details).items() if v is not None)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "report") -> TrainReport:
        """The report :meth:`to_json` wrote (older ``pipeswap.train/2`` files too)."""
        check_format(obj, REPORT_FORMAT, where)
        try:
            details: dict[str, Any] = {}
            if obj["mode"] == "data-parallel":
                details["data_parallel"] = details_from_json(DataParallelDetails, obj)
            else:
                details["pipeline"] = details_from_json(PipelineDetails, obj)
            return cls(**_values_of(cls, obj, skip=("data_parallel", "pipeline")), **details)
        except (KeyError, TypeError) as exc:
            raise PipeswapError(f"{where}: malformed training report ({exc!r})") from None


def details_from_json(kind: type, obj: dict[str, Any]) -> Any:
    """The ``kind`` details (DataParallelDetails, PipelineDetails) among a report's keys."""
    return kind(**_values_of(kind, obj))


def _values_of(kind: type, obj: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keys of ``obj`` that are fields of ``kind`` (one without a default must be
    there: a KeyError says which is missing)."""
    return {
        f.name: obj[f.name]
        for f in dataclasses.fields(kind)
        if f.name not in skip
        and (
            f.name in obj
            or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        )
    }


def write_report(path: str | os.PathLike[str], report: TrainReport) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file and a rename)."""
    dump_json(path, report.to_json())


def load_report(path: str | os.PathLike[str]) -> TrainReport:
    """Read a ``pipeswap.train/2`` report; an older report is refused with what to do."""
    obj = load_json(path)
    found = obj.get("format")
    if found in OLD_FORMATS:
        raise PipeswapError(
            f"{path} is a {OLD_FORMATS[found]} report in the old format {found!r}, whose "
            f"params_sha256 is not comparable across modes; run `pipeswap train ... --report` "
            f"again to write a {REPORT_FORMAT} report"
        )
    if found != REPORT_FORMAT:
        raise PipeswapError(
            f"{path}: expected format {REPORT_FORMAT!r}, found {found!r}; this file is not a "
            "pipeswap training report"
        )
    return TrainReport.from_json(obj, str(path))
