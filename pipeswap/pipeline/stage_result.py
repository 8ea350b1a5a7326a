"""StageResult: what one stage reports after training, plain data that crosses processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeswap.metrics import HeldOutSums
from pipeswap.schedule.timetable import TimedAction

__all__ = ["StageResult"]


@dataclass
class StageResult:
    """What one rank reports after training (plain data: it crosses process boundaries)."""

    rank: int
    losses: dict[int, float] = field(default_factory=dict)
    held_out: HeldOutSums = field(default_factory=HeldOutSums)  # scored after training
    # Every eval_every steps (last stage): (steps done, the held-out score).
    evals: list[tuple[int, dict[str, float | int]]] = field(default_factory=list)
    busy_s: float = 0.0
    wall_s: float = 0.0
    sha256: str = ""  # this stage's parameters (pipeswap.dist.digest)
    param_digests: dict[str, str] = field(default_factory=dict)
    prediction_error: dict[str, float | None] | None = None
    distances: tuple[int, int] = (0, 0)
    timeline: list[TimedAction] = field(default_factory=list)
    # This stage's trained tensors by their names in the whole model (on the CPU), when
    # the run saves the trained model.
    state: dict[str, torch.Tensor] | None = None
    # A stage that swaps: its swapper's figures (pipeswap.swap.runtime.unit_swapper.UnitSwapper.stats).
    memory: dict[str, Any] | None = None
    # The device's meter over the first steps (pipeswap.pipeline.stage_meter); -1: none ran.
    peak_resident_bytes: int = -1
