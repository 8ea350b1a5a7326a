"""Saved tensors changed in place after they were saved: refused, as autograd refuses them.

Autograd checks each saved tensor's version when the backward unpacks it, and refuses one
that an in-place operation changed since it was saved ("one of the variables needed for
gradient computation has been modified by an inplace operation"). Saved-tensor hooks skip
that check: under pipeswap's, the backward read what the storage held by then, or a host
copy made after the change, and a loop that autograd refuses ran on with wrong gradients.

:class:`SavedVersions` gives the check back to the hooks: it notes a weak reference to each
tensor saved on a storage (the object the model's code holds: no storage is kept alive
by it) with its version, and :meth:`SavedVersions.settle` compares those still alive: at
each layer's edge (a block's output changed in place by the code after it), before the
storage goes to the host, and at the unpack, which then refuses a change seen. (A change
made after the copy to the host reaches no backward: it reads the copy, as saved.)
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SavedVersions", "refuse_changed"]


class SavedVersions:
    """The tensors saved on one storage and their versions, while the device holds it."""

    __slots__ = ("_seen", "changed")

    def __init__(self) -> None:
        self._seen: list[tuple[weakref.ref[torch.Tensor], int]] = []
        self.changed: str | None = None  # the first change seen, described

    def note(self, tensor: torch.Tensor) -> None:
        """``tensor`` was saved now (a leaf that needs no gradient is not checked: an input,
        a buffer pipeswap's own re-runs put back in place)."""
        if tensor.grad_fn is not None or tensor.requires_grad:
            try:
                self._seen.append((weakref.ref(tensor), tensor._version))
            except TypeError:  # a tensor kind with no weak references: not checked
                pass

    def settle(self, *, done: bool = True) -> None:
        """Compare the versions of those still alive now; ``done``: the last time (the
        storage goes to the host, or is unpacked)."""
        for saved, version in self._seen:
            tensor = saved()
            if tensor is not None and tensor._version != version and self.changed is None:
                self.changed = _changed(tensor, version)
        if done:
            self._seen.clear()

    def check(self) -> None:
        """Settle, and refuse a change seen (at an unpack)."""
        self.settle()
        if self.changed is not None:
            refuse_changed(self.changed)


def _changed(tensor: torch.Tensor, version: int) -> str:
    return (
        f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
        f"version {version} instead"
    )


def refuse_changed(described: str) -> None:
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: {described}. It was saved for the backward and then changed in "
        "place, which autograd refuses without pipeswap too: write that operation out of "
        "place (y = y * 2, not y.mul_(2))"
    )
