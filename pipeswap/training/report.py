"""The training report, ``pipeswap.train/2``: the same core keys in every mode, written atomically.

Every report has ``format``, ``mode`` (``data-parallel``, ``pipeline`` or ``emulate``),
``model``, ``steps``, ``losses`` (one per optimizer step), ``params_sha256`` (the digest
of :func:`pipeswap.dist.digest.params_sha256`, the same definition in every mode), the
run's shape and optimizer, and ``train_config``; then the keys of its mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json, load_json
from pipeswap.training.config import TrainConfig

REPORT_FORMAT = "pipeswap.train/2"
# What pipeswap 0.1 wrote, before one report served every mode.
OLD_FORMATS = {
    "pipeswap.swaptrain/1": "data-parallel",
    "pipeswap.train-report/1": "pipeline",
}


def base_report(
    config: TrainConfig, *, losses: Sequence[float], params_sha256: str, nproc: int
) -> dict[str, Any]:
    """The keys every mode reports, from the resolved config and what the run measured."""
    return {
        "format": REPORT_FORMAT,
        "mode": config.mode,
        "model": config.model,
        "steps": config.steps,
        "losses": [float(x) for x in losses],
        "params_sha256": params_sha256,
        "batch": config.batch,
        "seq_len": config.seq_len,
        "image_size": config.image_size,
        "seed": config.seed,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "momentum": config.momentum,
        "weight_decay": config.weight_decay,
        "device": config.device,
        "nproc": nproc,
        "train_config": config.to_json(),
    }


def write_report(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` atomically (a temporary file and a rename)."""
    dump_json(path, report)


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
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
    return obj
