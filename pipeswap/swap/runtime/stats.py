"""What one swap-executor step did: bytes held, moved and recomputed, and its time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StepStats"]


@dataclass(frozen=True)
class StepStats:
    """What one executor step did (one micro-batch's forward and backward)."""

    peak_saved_bytes: int  # most bytes of saved tensors held on the device at once
    swapped_bytes: int  # bytes copied to the host pool
    prefetched_bytes: int  # bytes copied back (prefetched or fetched late)
    late_fetches: int  # tensors unpacked before their prefetch was issued
    seconds: float
    recomputed_layers: int = 0  # layers whose forward was run again in the backward
    recomputed_bytes: int = 0  # bytes those re-runs saved (as measured by prepare)
    selective_layers: int = 0  # of those, the layers recomputed selectively
    # bytes not held because the same cast of a tensor was saved before (cast_twins)
    shared_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_saved_bytes": self.peak_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "prefetched_bytes": self.prefetched_bytes,
            "late_fetches": self.late_fetches,
            "seconds": self.seconds,
            "recomputed_layers": self.recomputed_layers,
            "recomputed_bytes": self.recomputed_bytes,
            "selective_layers": self.selective_layers,
            "shared_bytes": self.shared_bytes,
        }
