"""What a data-parallel rank measures: as it trains (RankRecord) and when it ends (RankResult)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeswap.metrics import HeldOutSums

__all__ = ["RankRecord", "RankResult", "measured_step_s"]


@dataclass(frozen=True)
class RankResult:
    """What one rank measured."""

    rank: int
    losses: tuple[float, ...]  # per step: the mean of its micro-batch losses
    step_s: tuple[float, ...]
    params_sha256: str
    peak_resident_bytes: int  # the device's meter over the first steps (step()); -1: none ran
    peak_saved_bytes: int
    budget_bytes: int
    saved_budget_bytes: int
    swapped_bytes: int  # per iteration
    late_fetches: int  # over the whole run
    offset_s: float
    recomputed_layers: int = 0  # layers run forward again in the backward, per iteration
    recomputed_bytes: int = 0  # bytes those re-runs saved, per iteration
    # Buffers (BatchNorm statistics), digested as params_sha256 digests parameters: a
    # recomputed layer's re-run must not update them a second time.
    buffers_sha256: str = ""
    held_out: HeldOutSums | None = None  # the held-out score after training, on this rank
    # Every eval_every steps: (steps done, the score over every rank's held-out batches).
    evals: tuple[tuple[int, dict[str, float | int]], ...] = ()
    stopped_by: str | None = None  # the signal that ended the run before its last step


@dataclass
class RankRecord:
    """What a rank has measured so far: carried across steps and in its checkpoints."""

    done: int = 0
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    late: int = 0
    swapped: int = 0  # of the last step
    recomputed_layers: int = 0
    recomputed_bytes: int = 0
    evals: list[tuple[int, dict[str, float | int]]] = field(default_factory=list)


def measured_step_s(results: Sequence[RankResult]) -> float:
    """Median over steps (the first one left out when there are more) of the slowest rank."""
    steps = len(results[0].step_s)
    slowest = [max(r.step_s[s] for r in results) for s in range(steps)]
    return statistics.median(slowest[1:] if steps > 1 else slowest)
