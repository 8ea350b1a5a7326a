"""StepMemory: what a meter read during one step, at the layers' edges (part of a Profile)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeswap import json_fields as fields
from pipeswap.errors import PipeswapError

__all__ = ["StepMemory"]


@dataclass(frozen=True)
class StepMemory:
    """What the device held during one step, read by a meter that is not pipeswap's ledger
    (pipeswap.profiling.meter: CUDA's allocator, or the live storages) at the layers' edges.

    Every figure is the most bytes held in an interval: ``forward_peak_bytes[i]`` while
    layer i's forward ran (layer 0's from the model's forward start); ``turn_peak_bytes``
    from the last layer's forward end to its backward's start (the model's head, logits,
    loss and their backward); ``backward_peak_bytes[i]`` while layer i's backward ran
    (layer 0's to the backward's end); ``step_peak_bytes`` from the end of the backward to
    the next forward (the optimizer step; 0 when not seen).
    ``start_bytes`` is what was held when the forward started: parameters, optimizer state,
    gradients kept from the step before, the batch. ``meter`` names the meter.
    """

    start_bytes: int
    forward_peak_bytes: tuple[int, ...]
    turn_peak_bytes: int
    backward_peak_bytes: tuple[int, ...]
    step_peak_bytes: int = 0
    meter: str = "storages"

    @property
    def peak_bytes(self) -> int:
        """The most held over the whole step."""
        return max(
            self.start_bytes,
            self.turn_peak_bytes,
            self.step_peak_bytes,
            *self.forward_peak_bytes,
            *self.backward_peak_bytes,
        )

    def moved(self, nbytes: int) -> StepMemory:
        """Every reading ``nbytes`` higher: what the run holds throughout beyond this step
        (DDP's gradient buckets)."""
        return replace(
            self,
            start_bytes=self.start_bytes + nbytes,
            forward_peak_bytes=tuple(b + nbytes for b in self.forward_peak_bytes),
            turn_peak_bytes=self.turn_peak_bytes + nbytes,
            backward_peak_bytes=tuple(b + nbytes for b in self.backward_peak_bytes),
            step_peak_bytes=self.step_peak_bytes + nbytes,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "meter": self.meter,
            "start_bytes": self.start_bytes,
            "forward_peak_bytes": list(self.forward_peak_bytes),
            "turn_peak_bytes": self.turn_peak_bytes,
            "backward_peak_bytes": list(self.backward_peak_bytes),
            "step_peak_bytes": self.step_peak_bytes,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str, layers: int) -> StepMemory:
        obj = fields.as_object(obj, where)
        peaks = {}
        for key in ("forward_peak_bytes", "backward_peak_bytes"):
            values = fields.list_field(obj, key, where)
            if len(values) != layers:
                raise PipeswapError(
                    f"{where}: {key} has {len(values)} entries for {layers} layers; write one "
                    "per layer"
                )
            peaks[key] = tuple(
                fields.count_field({key: v}, key, f"{where}: {key}[{k}]")
                for k, v in enumerate(values)
            )
        return cls(
            start_bytes=fields.count_field(obj, "start_bytes", where),
            forward_peak_bytes=peaks["forward_peak_bytes"],
            turn_peak_bytes=fields.count_field(obj, "turn_peak_bytes", where),
            backward_peak_bytes=peaks["backward_peak_bytes"],
            step_peak_bytes=fields.count_field(obj, "step_peak_bytes", where, default=0),
            meter=fields.text_field(obj, "meter", where, "storages"),
        )
