"""The buffers a recomputed layer's forward changed, as that forward found them.

A training-mode forward may read and update a buffer in place: BatchNorm's running
statistics (which its output does not read), but also ``spectral_norm``'s power iteration,
whose ``_u`` and ``_v`` decide the normalised weight the forward uses. A re-run in the
backward has to start from the values the forward started from, or it computes with one
more iteration than the forward did, and the gradients differ from training without
recomputation. :class:`ForwardBuffers` copies a layer's buffers before its forward and
keeps the copies of those the forward changed (a tensor's version counter says which);
:meth:`ForwardBuffers.rerun` runs the re-run from them and leaves every buffer as it found it.
Which buffers a layer changes is remembered per layer, so after its first forward only
those are copied (the others, a rotary table or a causal mask, may be large).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class ChangedBuffers:
    """Per layer name and mode (training or not), which of its buffers (by position in
    ``module.buffers()``) its forward changes; a layer not met yet in that mode has every
    buffer copied once."""

    def __init__(self) -> None:
        self._changed: dict[tuple[str, bool], frozenset[int]] = {}

    def before_forward(self, name: str, module: nn.Module) -> ForwardBuffers:
        """The copies to take before ``module``'s forward (call :meth:`ForwardBuffers.kept`
        after it)."""
        key = (name, module.training)
        buffers = list(module.buffers())
        known = self._changed.get(key)
        copied = frozenset(range(len(buffers))) if known is None else known
        return ForwardBuffers(lambda changed: self._note(key, changed), buffers, copied)

    def _note(self, key: tuple[str, bool], changed: frozenset[int]) -> None:
        self._changed[key] = self._changed.get(key, frozenset()) | changed


class ForwardBuffers:
    """A layer's buffers, with the values from before its forward of those it changes."""

    def __init__(
        self,
        note: Callable[[frozenset[int]], None],
        buffers: list[torch.Tensor],
        copied: frozenset[int],
    ) -> None:
        self._note = note
        self._versions = [(b, b._version) for b in buffers]
        self._copies = {i: buffers[i].detach().clone() for i in copied if i < len(buffers)}

    def kept(self) -> ForwardBuffers:
        """After the forward: keep the copies of the buffers it changed, drop the others.
        (A buffer it changed that had no copy, in a layer met before, is copied from its next
        forward on.)"""
        changed = frozenset(i for i, (b, v) in enumerate(self._versions) if b._version != v)
        self._copies = {i: c for i, c in self._copies.items() if i in changed}
        self._note(changed)
        return self

    def rerun(self, module: nn.Module, forward: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``forward`` again from the buffers as the first forward found them; afterwards
        every buffer of ``module`` is as it was before this call."""
        now = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            with torch.no_grad():
                for i, values in self._copies.items():
                    self._versions[i][0].copy_(values)
            return forward(*args, **kw)
        finally:  # also when torch stops the re-run early (all it needs is saved)
            with torch.no_grad():
                for buffer, values in now:
                    buffer.copy_(values)
