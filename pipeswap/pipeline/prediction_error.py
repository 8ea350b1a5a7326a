"""How far a stage's predicted weights were from the weights its mini-batch's update met."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["PassRecord", "PredictionError", "finite"]


@dataclass
class PredictionError:
    """Sums over passes of ||W_used - W_future|| and ||W_now - W_future|| (one pass kind)."""

    used: float = 0.0
    stale: float = 0.0
    passes: int = 0

    @property
    def ratio(self) -> float | None:
        """||W_hat - W_future|| / ||W_now - W_future||; None when nothing was stale."""
        return self.used / self.stale if self.stale > 0 else None


@dataclass
class PassRecord:
    """The live weights at a pass (``now``) and the ones it ran on (``used``), flattened."""

    now: torch.Tensor
    used: torch.Tensor


def finite(value: float | None) -> float | None:
    """``value``, or None where it is none or not finite (a report's JSON takes no inf)."""
    return None if value is None or not math.isfinite(value) else value
