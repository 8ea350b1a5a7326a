"""LogConfig and the per-step log of a run: a line on stderr, JSON lines, TensorBoard."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeswap.config_fields import ConfigError, option, require
from pipeswap.progress import thread_lock_for_bars

__all__ = ["HeldOutSums", "LogConfig", "StepLog"]


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """What a run logs per optimizer step, on rank 0: ``log_every`` prints a line on
    stderr every that many steps (a terminal or a log file alike); ``metrics`` writes
    every step as a JSON line (``step``, ``loss``, ``lr``, ``step_s``), each held-out
    score (``eval``, every ``eval_every`` steps and at the end, last); ``tensorboard``
    writes the same scalars as TensorBoard event files. A step is logged as it ends by
    the process that knows its loss: in data parallelism rank 0 (the mean over the
    ranks', gathered each step: the summary's), in a pipeline the last stage."""

    log_every: int = option(
        10,
        metavar="N",
        help="print a line every N steps on stderr, to a terminal or a log file (0: never)",
    )
    metrics: str | None = option(
        None,
        metavar="PATH",
        help="write each step's loss, learning rate and time as JSON lines (to PATH.partial, "
        "renamed to PATH at the end; a resumed run keeps the earlier steps' lines)",
    )
    tensorboard: str | None = option(
        None,
        metavar="DIR",
        help="write the same scalars as TensorBoard event files (needs the tensorboard "
        "package: pip install 'pipeswap[tensorboard]')",
    )

    def __post_init__(self) -> None:
        require(self.log_every >= 0, f"{{log_every}} is {self.log_every}; use 0 or more")
        for name, value in (("metrics", self.metrics), ("tensorboard", self.tensorboard)):
            require(value != "", f"{{{name}}} is empty; name a path")

    def check_available(self) -> None:
        """Refuse ``tensorboard`` without the package it needs, before a run starts."""
        if self.tensorboard is not None:
            _summary_writer()


def _summary_writer() -> Any:
    """TensorBoard's SummaryWriter, or the ConfigError that says what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "{tensorboard} needs the tensorboard package: pip install 'pipeswap[tensorboard]' "
            "(or pip install tensorboard), or drop {tensorboard} ({metrics} writes JSON lines "
            "without it)"
        ) from None
    return SummaryWriter


@dataclass(frozen=True)
class HeldOutSums:
    """Sums over held-out batches, added up over ranks or rounds before they are divided:
    ``batches`` scored, the sum of each batch's mean ``loss``, and for classifiers the
    predictions equal to the label (``correct``) over ``samples``."""

    batches: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def __add__(self, other: HeldOutSums) -> HeldOutSums:
        return HeldOutSums(
            self.batches + other.batches,
            self.loss_sum + other.loss_sum,
            self.correct + other.correct,
            self.samples + other.samples,
        )

    @staticmethod
    def total(parts: Iterable[HeldOutSums]) -> HeldOutSums:
        out = HeldOutSums()
        for part in parts:
            out = out + part
        return out

    def score(self, batches: int, *, classify: bool) -> dict[str, float | int]:
        """A report's ``eval``: ``batches`` (data parallelism: every rank's, this sum's
        ``batches``), the mean batch loss and, for classifiers, the accuracy; no loss
        when nothing was scored."""
        score: dict[str, float | int] = {"batches": batches}
        if self.batches:
            score["loss"] = self.loss_sum / self.batches
            if classify:
                score["accuracy"] = self.correct / self.samples
        return score


class StepLog:
    """The log of one run, open on rank 0 (elsewhere it does nothing)."""

    def __init__(
        self, config: LogConfig, steps: int, *, enabled: bool = True, live: bool = True
    ) -> None:
        self.config, self.steps = config, steps
        self._file: IO[str] | None = None
        self._partial: Path | None = None
        self._started = False
        self._board: Any = None
        # A line every log_every steps, to a log file too: a run sent to one is followed.
        self._lines = enabled and live and config.log_every > 0
        if not enabled:
            return
        if config.metrics is not None:
            # Written beside the file and renamed over it at the end: a run that stops
            # leaves the user's file as it was, never half-written.
            self._partial = Path(f"{config.metrics}.partial")
            self._file = open(self._partial, "w", encoding="utf-8")  # noqa: SIM115
        if config.tensorboard is not None:
            self._board = _summary_writer()(config.tensorboard)

    def step(self, step: int, loss: float, lr: float, step_s: float | None = None) -> None:
        """Record optimizer step ``step`` (0-based)."""
        if self._file is not None:
            self._resumed_from(step)
            entry = {"step": step + 1, "loss": loss, "lr": lr, "step_s": step_s}
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()
        if self._board is not None:
            self._board.add_scalar("train/loss", loss, step + 1)
            self._board.add_scalar("train/lr", lr, step + 1)
        if self._lines and (step + 1) % self.config.log_every == 0:
            took = "" if step_s is None else f"  {step_s * 1e3:.1f} ms"
            self._write(f"step {step + 1}/{self.steps}  loss {loss:.4f}  lr {lr:.3g}{took}")

    def eval(self, step: int, score: dict[str, float | int]) -> None:
        """Record the held-out score after optimizer step ``step`` (0-based) of a run that
        scores every ``eval_every`` steps (the score at the end goes to :meth:`close`)."""
        if self._file is not None:
            self._resumed_from(step)
            self._file.write(json.dumps({"step": step + 1, "eval": score}) + "\n")
            self._file.flush()
        self._board_eval(score, step + 1)
        if self._lines and "loss" in score:
            extra = f"  accuracy {score['accuracy']:.4f}" if "accuracy" in score else ""
            self._write(f"step {step + 1}/{self.steps}  held-out loss {score['loss']:.4f}{extra}")

    def _resumed_from(self, step: int) -> None:
        """Before the first line: a run resumed at ``step`` (0-based) keeps the lines of
        the steps before it from the file the run it resumes wrote."""
        if self._started:
            return
        self._started = True
        target = Path(str(self.config.metrics))
        if step == 0 or not target.is_file() or self._file is None:
            return
        with open(target, encoding="utf-8") as earlier:
            for line in earlier:
                try:
                    done = json.loads(line).get("step", 0) <= step
                except (ValueError, AttributeError):
                    continue  # not a line of ours
                if done:
                    self._file.write(line if line.endswith("\n") else line + "\n")

    def _board_eval(self, score: dict[str, float | int], step: int) -> None:
        if self._board is not None:
            for key, value in score.items():
                if key != "batches":
                    self._board.add_scalar(f"eval/{key}", value, step)

    @staticmethod
    def _write(line: str) -> None:
        from tqdm import tqdm

        thread_lock_for_bars()  # (tqdm's own lock would leak a semaphore at a rank's end)
        tqdm.write(line, file=sys.stderr)  # above a progress bar, not through it
        sys.stderr.flush()

    def close(self, held_out: dict[str, float | int] | None = None) -> None:
        """Record the held-out score (when there is one) and close the files."""
        if self._file is not None:
            if held_out:
                self._file.write(json.dumps({"step": self.steps, "eval": held_out}) + "\n")
            self._file.close()
            self._file = None
            assert self._partial is not None
            os.replace(self._partial, str(self.config.metrics))
        if self._board is not None:
            self._board_eval(held_out or {}, self.steps)
            self._board.close()
            self._board = None

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
