"""When a plan's prefetches "after layer i's backward" start: once that backward is done
and layer i-1's has begun.

The plan counts a tensor prefetched after backward i on the host for all of backward i,
and the meter reads backward i from layer i's output gradient to layer i-1's (block_timing):
the code between the two layers (an encoder-decoder's decoder embedding, run in backward
after the decoder's first block) is inside that interval. Started at the end of layer i's
own backward, the prefetched tensors were back beside that code's gradients, which the
plan counted without them: BART's swap plans held 1.006x (fp32) and 1.015x (bf16 autocast)
their budgets. What that code saves is layer i's (pipeswap.profiling.saved), so none of
the tensors prefetched is needed before layer i-1's backward begins. Where the layers feed
each other directly the two events are one gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pipeswap.swap.plan.tensors import SavedKey

__all__ = ["PrefetchGate"]


class PrefetchGate:
    """Calls ``prefetch(key)`` for each of ``after[name]`` once layer ``name``'s backward is
    :meth:`done` and, where the forward saw the layer before it return an output that needs
    a gradient (:meth:`watch_previous`), once that layer's backward has begun too,
    whichever comes last (layers that are not a chain, whose gradients come in either
    order, wait for both)."""

    def __init__(
        self, after: Mapping[str, Sequence[SavedKey]], prefetch: Callable[[SavedKey], None]
    ) -> None:
        self._after = after
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
        if name not in self._awaiting:
            self._start(name)

    def _begun(self, name: str) -> None:
        self._awaiting.discard(name)
        if name in self._done:
            self._start(name)

    def _start(self, name: str) -> None:
        for key in self._after.get(name, ()):
            self._prefetch(key)
