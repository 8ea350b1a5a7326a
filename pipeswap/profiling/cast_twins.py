"""Saved tensors that repeat one already saved: the same cast of the same tensor, kept once.

Under autocast every matmul casts its input anew: autocast caches the casts of weights,
never of activations. A block whose normalised input feeds three projections (a query,
key and value, unfused) has autograd save three bf16 copies of one tensor, and one whose
input feeds a gate and an up projection two; an explicit ``x.to(dtype)`` twice does the
same. The copies hold equal bytes: a cast of the same values to the same dtype rounds the
same way. :meth:`CastTwins.share` hands the pack hook the copy saved first in place of a
later one, whose storage is then let go of as soon as its matmul has run: the backward
reads the same values, so results are bit for bit the same, and no time is spent.

Two saved tensors are twins when each is (a view of) the output of a cast
(``ToCopyBackward0``) of the same autograd output, to the same dtype, device and layout,
and their views are alike. An in-place write to the source between the two casts gives
the source a new autograd node, so a cast of the written values is never taken for one of
the old. Only tensors saved within one layer's forward are matched (:meth:`reset` at each
layer's edge): the copies held for matching are the layer's own, which it saves anyway.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CastTwins"]

_CAST = "ToCopyBackward0"


class CastTwins:
    """The casts saved so far in one layer's forward, by what they cast; see the module."""

    __slots__ = ("_first", "shared_bytes")

    def __init__(self) -> None:
        # key (its source's autograd node first, held so its id is not reused) -> the
        # first saved view
        self._first: dict[tuple[Any, ...], torch.Tensor] = {}
        self.shared_bytes = 0  # bytes of storages not held because a twin was

    def reset(self) -> None:
        """A layer's edge: let go of the tensors held for matching."""
        self._first.clear()

    def share(self, tensor: torch.Tensor) -> torch.Tensor:
        """The twin of ``tensor`` saved earlier in this layer, or ``tensor`` itself."""
        key = _cast_key(tensor)
        if key is None:
            return tensor
        twin = self._first.setdefault(key, tensor)
        if twin is tensor:
            return tensor
        # (The storage's own address, exact on meta too, as pipeswap.profiling.saved keys it.)
        if twin.untyped_storage()._cdata != tensor.untyped_storage()._cdata:
            self.shared_bytes += tensor.untyped_storage().nbytes()
        return twin


def _cast_key(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided:
        return None  # a subclass (DTensor, float8) keeps its own kind
    base = tensor if tensor._base is None else tensor._base
    node = base.grad_fn
    if node is None or type(node).__name__ != _CAST:
        return None
    source, output = node.next_functions[0]
    if source is None:  # the cast of a tensor that needs no gradient: nothing to match on
        return None
    return (
        source,
        output,
        base.dtype,
        base.device,
        tuple(base.shape),
        base.stride(),
        base.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.storage_offset(),
    )
