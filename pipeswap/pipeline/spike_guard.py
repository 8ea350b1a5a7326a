"""A stage's guard against gradient spikes: clip a norm far above the stage's recent ones.

Part of the stability rule of asynchronous schedules (with the delay-scaled learning rate,
pipeswap.pipeline.predict.delay_lr_scale). A stage that takes delayed gradients, or runs a
pass on predicted weights and its backward on the live ones, can see a gradient many times
its usual size; with momentum that one step grows into the next stage's spike, and the run
diverges within a few updates (a Hugging Face Llama, 8 stages, SGD at 0.2:
docs/results/pipeline_robustness.md). The guard follows ZClip (Kumar et al., arXiv
2504.02507: z-score anomaly detection on an exponential moving average of gradient norms,
z 2.5, alpha 0.97): after a warm-up of plain updates, a norm above mean + Z * std of the
stage's recent norms is scaled down to that bound, and the statistics take the clipped
norm. Each stage keeps its own statistics from its own gradients, so the stages need not
meet (clip_grad_norm's global norm does), and the emulator and the runtime compute the same
numbers bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["SPIKE_ALPHA", "SPIKE_WARMUP", "SPIKE_Z", "SpikeGuard"]

SPIKE_Z = 2.5  # standard deviations above the mean where a norm counts as a spike
SPIKE_ALPHA = 0.97  # the moving averages' decay per update
SPIKE_WARMUP = 5  # updates whose norms only feed the statistics


@dataclass
class SpikeGuard:
    """The moving mean and variance of one stage's gradient norms, and the clip they set."""

    z: float = SPIKE_Z
    alpha: float = SPIKE_ALPHA
    warmup: int = SPIKE_WARMUP
    seen: int = 0
    mean: float = 0.0
    variance: float = 0.0
    clipped: int = 0

    def factor(self, norm: float) -> float:
        """What to multiply this update's gradient by (1.0 unless ``norm`` is a spike), and
        the statistics updated with the norm the update will apply. A norm that is not
        finite is left to the run's own check (it stops a run whose loss is not finite)."""
        if not math.isfinite(norm):
            return 1.0
        scale = 1.0
        if self.seen >= self.warmup:
            bound = self.mean + self.z * math.sqrt(self.variance)
            if norm > bound > 0:
                scale = bound / norm
                norm = bound
                self.clipped += 1
        if self.seen == 0:
            self.mean = norm
        else:
            delta = norm - self.mean
            self.mean += (1 - self.alpha) * delta
            self.variance = self.alpha * (self.variance + (1 - self.alpha) * delta * delta)
        self.seen += 1
        return scale

    def state(self) -> dict[str, Any]:
        return {
            "seen": self.seen,
            "mean": self.mean,
            "variance": self.variance,
            "clipped": self.clipped,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]
        self.mean = state["mean"]
        self.variance = state["variance"]
        self.clipped = state["clipped"]
