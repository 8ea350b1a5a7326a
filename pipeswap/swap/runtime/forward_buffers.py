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

So with the plain numbers its modules keep as attributes (a step counter a forward moves
on, ``self.calls += 1``, and reads): the re-run starts from them as the forward found
them, and leaves them as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ChangedBuffers", "ForwardBuffers"]

# Plain numbers a forward may move on; a module's own flags are no state of the forward's.
_NUMBERS = (int, float, bool)
_MODULE_OWN = frozenset({"training", "_is_full_backward_hook"})


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
        numbers = [
            (m, k, v)
            for m in module.modules()
            for k, v in vars(m).items()
            if type(v) in _NUMBERS and k not in _MODULE_OWN
        ]
        return ForwardBuffers(lambda changed: self._note(key, changed), buffers, copied, numbers)

    def _note(self, key: tuple[str, bool], changed: frozenset[int]) -> None:
        self._changed[key] = self._changed.get(key, frozenset()) | changed


class ForwardBuffers:
    """A layer's buffers, with the values from before its forward of those it changes."""

    def __init__(
        self,
        note: Callable[[frozenset[int]], None],
        buffers: list[torch.Tensor],
        copied: frozenset[int],
        numbers: list[tuple[nn.Module, str, Any]],
    ) -> None:
        self._note = note
        self._versions = [(b, b._version) for b in buffers]
        self._copies = {i: buffers[i].detach().clone() for i in copied if i < len(buffers)}
        self._numbers = numbers  # (module, attribute, value before the forward)

    def kept(self) -> ForwardBuffers:
        """After the forward: keep the copies of the buffers it changed, drop the others.
        (A buffer it changed that had no copy, in a layer met before, is copied from its next
        forward on.)"""
        changed = frozenset(i for i, (b, v) in enumerate(self._versions) if b._version != v)
        self._copies = {i: c for i, c in self._copies.items() if i in changed}
        self._note(changed)
        self._numbers = [(m, k, v) for m, k, v in self._numbers if getattr(m, k, v) is not v]
        return self

    def rerun(self, module: nn.Module, forward: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``forward`` again from the buffers as the first forward found them; afterwards
        every buffer of ``module`` is as it was before this call."""
        now = [(b, b.detach().clone()) for b in module.buffers()]
        numbers = [(m, k, getattr(m, k)) for m, k, _ in self._numbers]
        try:
            with torch.no_grad():
                for i, values in self._copies.items():
                    self._versions[i][0].copy_(values)
            for m, k, value in self._numbers:
                setattr(m, k, value)
            return forward(*args, **kw)
        finally:  # also when torch stops the re-run early (all it needs is saved)
            with torch.no_grad():
                for buffer, values in now:
                    buffer.copy_(values)
            for m, k, value in numbers:
                setattr(m, k, value)
