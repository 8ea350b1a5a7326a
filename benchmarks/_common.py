"""What every benchmark script shares: the machine line, the command line, medians, the header."""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"


def machine() -> str:
    """Platform, CPU count and model, Python and torch versions, in one line."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # the simulator itself does not need torch
        torch_version = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(
                line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs ({cpu}), "
        f"Python {platform.python_version()}, torch {torch_version}"
    )


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reruns ``script`` (a path under benchmarks/) with these arguments."""
    given = sys.argv[1:] if argv is None else list(argv)
    return " ".join([".venv/bin/python", f"benchmarks/{script}", *given]).strip()


def header(title: str, script: str, argv: Sequence[str] | None) -> str:
    """The title, the command that regenerates the file, the machine and today's date."""
    return (
        f"# {title}\n\n"
        f"Command: `{command_line(script, argv)}`  \n"
        f"Machine: {machine()}  \n"
        f"Date: {datetime.date.today().isoformat()}\n\n"
    )


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    if not values:
        return math.nan, math.nan, math.nan
    return statistics.median(values), min(values), max(values)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
