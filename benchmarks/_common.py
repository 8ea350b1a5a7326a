"""What every benchmark script shares: the header, statistics, a job pool and a records cache."""

from __future__ import annotations

import datetime
import math
import multiprocessing
import os
import platform
import statistics
import sys
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pipeswap.jsonio import dump_json, load_json

Job = TypeVar("Job")
Record = dict[str, Any]  # one finished job's results, JSON-ready

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"


def machine() -> str:
    """Platform, CPU count and model, Python and torch versions, in one line."""
    try:
        import torch

        torch_version = str(torch.__version__)
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


@dataclass(frozen=True)
class RunLoad:
    """How long a benchmark's run took, and the machine's 1-minute load average before and
    after it (other jobs may share the cores: a page says so beside its numbers)."""

    elapsed_s: float
    load_before: float
    load_after: float

    def sentence(self) -> str:
        return (
            f"The whole run took {self.elapsed_s:.0f} s; the machine's 1-minute load average "
            f"was {self.load_before:.1f} before and {self.load_after:.1f} after"
        )


def timed_run(run: Callable[[], Job]) -> tuple[Job, RunLoad]:
    """``run()``'s value, and how long it took under what load."""
    import time

    before, started = os.getloadavg()[0], time.perf_counter()
    value = run()
    return value, RunLoad(time.perf_counter() - started, before, os.getloadavg()[0])


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


def _no_description(record: Record) -> str:
    return ""


def run_jobs(
    work: Sequence[Job],
    run: Callable[[Job], Record],
    jobs: int,
    *,
    on_record: Callable[[Record], None] | None = None,
    describe: Callable[[Record], str] = _no_description,
) -> list[Record]:
    """``run(job)`` for every job of ``work``, in order, on ``jobs`` worker processes (1: here).

    Records arrive in ``work``'s order, so a stopped run has finished a prefix of it: put
    the jobs that matter most first. ``on_record`` sees each record as it arrives (to
    save it), and a progress line ``[i/n] describe(record) (wall s)`` is printed. Workers
    are spawned, not forked (forking a process whose torch thread pools are running is
    unsafe), so ``run`` must be a module-level function: workers import it by name.
    """
    out: list[Record] = []

    def done(i: int, record: Record) -> None:
        out.append(record)
        wall = f" ({record['wall_s']:.1f} s)" if "wall_s" in record else ""
        print(f"[{i}/{len(work)}] {describe(record)}{wall}", flush=True)
        if on_record is not None:
            on_record(record)

    if jobs <= 1 or len(work) <= 1:  # no worker to start for one job
        for i, job in enumerate(work, 1):
            done(i, run(job))
        return out
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for i, record in enumerate(pool.imap(run, work), 1):
            done(i, record)
    return out


@dataclass
class RecordCache:
    """A benchmark's finished jobs in one JSON file: resume a stopped run, re-render without work.

    ``format`` names the file's layout (``pipeswap.bench-<name>/<version>``); ``key`` maps
    a record to the job that made it, so ``done()`` is the set of jobs not to run again.
    ``argv`` is the command line that decides the results and ``elapsed_s`` the time spent
    on them, over every run that added records. With ``path`` set, every ``add`` rewrites
    the file (atomically), so a run stopped at any point keeps what finished.
    """

    format: str
    key: Callable[[Record], Hashable]
    path: Path | None = None
    records: list[Record] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    @classmethod
    def load(cls, path: Path, format: str, key: Callable[[Record], Hashable]) -> RecordCache:
        """The records saved at ``path`` (which must have ``format``); ``path`` is not kept."""
        saved = load_json(path, format)
        return cls(
            format,
            key,
            None,
            list(saved["records"]),
            list(saved["argv"]),
            float(saved["elapsed_s"]),
        )

    def done(self) -> set[Hashable]:
        return {self.key(r) for r in self.records}

    def add(self, record: Record, elapsed_s: float) -> None:
        """Keep a finished job's record (the total time is now ``elapsed_s``) and save."""
        self.records.append(record)
        self.elapsed_s = elapsed_s
        self.save()

    def save(self) -> None:
        if self.path is not None:
            dump_json(
                self.path,
                {
                    "format": self.format,
                    "elapsed_s": self.elapsed_s,
                    "argv": self.argv,
                    "records": self.records,
                },
            )


def emulate(config: Any, *, record: bool) -> dict[str, Any]:
    """One emulated pipeline run as a record: its losses, held-out scores and prediction
    error. pipeswap stops a run whose loss stops being finite (a ConfigError saying the
    training diverged); the benchmarks count such a run as diverged, with NaN scores."""
    from pipeswap.config_fields import ConfigError
    from pipeswap.pipeline.emulator import Emulator

    try:
        result = Emulator(config, record=record).run()
    except ConfigError as exc:
        if "training diverged" not in str(exc):
            raise
        return {"losses": [math.nan], "eval": {"loss": math.nan}, "prediction_error": None}
    return {
        "losses": list(result.losses),
        "eval": dict(result.eval),
        "prediction_error": result.prediction_error,
    }
