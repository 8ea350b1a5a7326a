"""What recomputing each layer of a model would keep and save again, measured by two
forwards (pipeswap.swap.runtime.recompute.Recomputation.capture), as a profile records it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from torch import nn

from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.selective import SelectiveChoice
from pipeswap.swap.runtime.transfer import DeviceLedger

__all__ = ["RecomputeSizes", "measure_recomputation"]


class RecomputeSizes(NamedTuple):
    """What each layer saves (named as plans name it), and per layer what recomputing it
    keeps through the step and what its re-run saves again, whole and selectively; ``held``:
    the attributes its forward left holding the graph (never recomputed)."""

    records: dict[str, list[CapturedSavedTensor]]
    kept: dict[str, int]
    rerun: dict[str, int]
    output: dict[str, int]  # pipeswap.swap.runtime.capture.InnerSaves.output_bytes
    choices: dict[str, SelectiveChoice]
    held: dict[str, tuple[str, ...]]

    def profile_fields(self, name: str, forward_s: float) -> dict[str, Any]:
        """LayerProfile's recomputation fields for layer ``name`` (forward ``forward_s``):
        whole, what it keeps and what its re-run saves; selectively, its input and kept
        outputs, what its re-run saves and the re-run's share of its forward."""
        fields: dict[str, Any] = {
            "kept_bytes": self.kept.get(name),
            "rerun_bytes": self.rerun.get(name),
            "rerun_output_bytes": self.output.get(name),
            "held_state": ", ".join(self.held.get(name, ())) or None,
        }
        choice = self.choices.get(name)
        if choice is not None and name in self.kept:
            fields["selective_kept_bytes"] = self.kept[name] + choice.cached_bytes
            fields["selective_rerun_bytes"] = choice.rerun_bytes
            fields["selective_rerun_s"] = forward_s * choice.rerun_fraction
        return fields


def measure_recomputation(
    model: nn.Module,
    layers: dict[str, nn.Module],
    names: list[str],
    forward_loss: Callable[[], Any],
    *,
    selective: bool = True,
) -> RecomputeSizes:
    """:class:`RecomputeSizes` from one plain forward and one with every layer wrapped for
    recomputation, as the runtime runs them (autocast's casts let go of at each layer's
    edge); with ``selective``, each
    layer's selective choice too (its operations noted: a slower plain forward)."""
    recomputation = Recomputation(layers, names, DeviceLedger(), account=False)
    recomputation.alone = True
    if selective:
        recomputation.choosing = frozenset(names)
    recomputation.install()
    try:
        (records, _), _ = recomputation.capture(model, forward_loss, names)
    finally:
        recomputation.remove()
    return RecomputeSizes(
        records,
        recomputation.kept_bytes,
        recomputation.rerun_bytes,
        recomputation.output_bytes,
        recomputation.choices,
        recomputation.held_state,
    )
