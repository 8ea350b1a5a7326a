"""When a plan's prefetches "after layer i's backward" start: those of layer i-1's own
tensors once that backward is done, the earlier layers' once layer i-1's has begun too.

The plan counts a tensor prefetched after backward i on the host for all of backward i,
and the meter reads backward i from layer i's output gradient to layer i-1's (block_timing):
the code between the two layers (an encoder-decoder's decoder embedding, run in backward
after the decoder's first block) is inside that interval. Started at the end of layer i's
own backward, the prefetched tensors were back beside that code's gradients, which the
plan counted without them: BART's swap plans held 1.006x (fp32) and 1.015x (bf16 autocast)
their budgets. That code's saved tensors are filed under layer i-1 (profiles file what runs
between two layers under the one before), so layer i-1's own still start at the end of
backward i, or the code would fetch them late. Where the layers feed each other directly
the two events are one gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pipeswap.swap.plan.tensors import SavedKey

__all__ = ["PrefetchGate"]


class PrefetchGate:
    """Calls ``prefetch(key)`` for each of ``after[name]`` once layer ``name``'s backward is
    :meth:`done` and, where the forward saw the previous layer (``previous[name]``) return
    an output that needs a gradient (:meth:`watch_previous`), once that layer's backward
    has begun too, whichever comes last (layers that are not a chain, whose gradients come
    in either order, wait for both); the previous layer's own tensors start at ``done``."""

    def __init__(
        self,
        after: Mapping[str, Sequence[SavedKey]],
        previous: Mapping[str, str],
        prefetch: Callable[[SavedKey], None],
    ) -> None:
        self._after = after
        self._previous = previous
        self._prefetch = prefetch
        self._done: set[str] = set()
        self._awaiting: set[str] = set()

    def start_step(self) -> None:
        self._done.clear()
        self._awaiting.clear()

    def watch_previous(self, name: str | None, output: torch.Tensor | None) -> None:
        """The forward of the layer before ``name`` returned ``output`` (its first tensor
        that needs a gradient, or None): ``name``'s prefetches wait for that gradient."""
        if name is None or output is None or name not in self._after:
            return
        self._awaiting.add(name)
        output.register_hook(lambda grad: self._begun(name))

    def done(self, name: str) -> None:
        """The backward of ``name`` is done (its input's gradient)."""
        self._done.add(name)
        previous = self._previous.get(name)
        waiting = name in self._awaiting
        self._start(name, lambda key: not waiting or key[0] == previous)

    def _begun(self, name: str) -> None:
        self._awaiting.discard(name)
        if name in self._done:
            self._start(name, lambda key: True)

    def _start(self, name: str, which: Callable[[SavedKey], bool]) -> None:
        for key in self._after.get(name, ()):
            if which(key):
                self._prefetch(key)
