"""One saved tensor and the swap decision about it, by layer position and by layer name.

A *saved tensor* is named (layer, index) everywhere and its size is ``bytes``. Planning
counts layers by their position in forward order: the ``...At`` types
(:class:`SavedTensorAt`, :class:`SwapDecisionAt`). Plans and the executor name layers:
``SavedKey`` (layer name, index) and :class:`~pipeswap.swap.plan.contract.SwapDecision`.
:meth:`SwapDecisionAt.decision` and :meth:`SwapDecisionAt.of_decision` convert between them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeswap.swap.plan.contract import SwapDecision

__all__ = ["SMALLEST_TENSOR_BYTES", "SavedKey", "SavedTensorAt", "SwapDecisionAt"]

# Smaller tensors (and recomputations freeing less) cannot change a plan measurably: the
# mip and auto policies leave them out.
SMALLEST_TENSOR_BYTES = 2**20


class SavedTensorAt(NamedTuple):
    """A saved tensor by its layer's position in forward order: position, saved index, bytes."""

    layer: int
    # The profiler's name; it shadows tuple.index, which nothing here calls.
    index: int  # type: ignore[assignment]
    bytes: int


# A saved tensor in name form, as the profiler and the executor name it: (layer, index).
SavedKey = tuple[str, int]


@dataclass(frozen=True)
class SwapDecisionAt:
    """A swap decision by layer position: layer ``layer``'s saved tensor ``index``.

    The swap-out is issued after forward ``out`` (>= layer); the prefetch after backward
    ``prefetch`` (in layer+1 .. L-1), or at the turn when ``prefetch == L``.
    """

    layer: int
    index: int
    bytes: int
    out: int
    prefetch: int

    @property
    def tensor(self) -> SavedTensorAt:
        return SavedTensorAt(self.layer, self.index, self.bytes)

    @classmethod
    def latest(cls, tensor: SavedTensorAt) -> SwapDecisionAt:
        """``tensor`` out right after its layer's forward, back right after the next
        layer's backward: the latest prefetch that is still issued before it is needed."""
        return cls(tensor.layer, tensor.index, tensor.bytes, tensor.layer, tensor.layer + 1)

    def decision(self, names: Sequence[str]) -> SwapDecision:
        """This swap in name form (``names``: the layers in forward order)."""
        return SwapDecision(
            layer=names[self.layer],
            index=self.index,
            bytes=self.bytes,
            out_after=names[self.out],
            prefetch_after=None if self.prefetch >= len(names) else names[self.prefetch],
        )

    @classmethod
    def of_decision(cls, decision: SwapDecision, position: Mapping[str, int]) -> SwapDecisionAt:
        """A decision in index form (``position``: layer name -> its place in forward order);
        a prefetch at the turn is the position after the last layer."""
        turn = len(position)
        prefetch = decision.prefetch_after
        return cls(
            position[decision.layer],
            decision.index,
            decision.bytes,
            position[decision.out_after],
            turn if prefetch is None else position[prefetch],
        )
