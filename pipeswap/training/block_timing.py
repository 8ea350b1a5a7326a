"""Each block's forward and backward time in one step of a user's loop, by hooks that leave
the autograd graph as it is."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


@dataclass
class BlockTiming:
    """One forward and backward of every layer, timed while a step ran unchanged: a
    layer's backward runs from its output's gradient to the previous layer's (the first
    layer's, to the end of the backward)."""

    forward_s: dict[str, float] = field(default_factory=dict)
    output_bytes: dict[str, int] = field(default_factory=dict)
    started: dict[tuple[str, str], float] = field(default_factory=dict)
    backward_started: dict[str, float] = field(default_factory=dict)
    ended: float | None = None

    def complete(self, names: list[str]) -> bool:
        return self.ended is not None and all(
            n in self.forward_s and n in self.backward_started for n in names
        )

    def backward_s(self, names: list[str]) -> dict[str, float]:
        assert self.ended is not None
        ends = [self.backward_started[n] for n in names[:-1]]
        return {
            n: max(0.0, end - self.backward_started[n])
            for n, end in zip(names, [self.ended, *ends], strict=True)
        }


def time_blocks(
    layers: dict[str, nn.Module], timing: BlockTiming, device: torch.device
) -> list[Any]:
    """Hooks that fill ``timing`` during the next forward and backward of ``layers``; the
    handles to remove them by (tensor hooks join the list as the forward runs)."""
    handles: list[Any] = []

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    for name, layer in layers.items():

        def forward_pre(m: nn.Module, a: Any, n: str = name) -> None:
            timing.started[(n, "forward")] = now()

        def started_backward(grad: torch.Tensor, n: str = name) -> None:
            if not timing.backward_started:  # the first: note when the backward ends
                queue = torch.autograd.Variable._execution_engine.queue_callback
                queue(lambda: setattr(timing, "ended", now()))
            timing.backward_started.setdefault(n, now())

        def forward_post(
            m: nn.Module, a: Any, out: Any, n: str = name, mark: Any = started_backward
        ) -> None:
            timing.forward_s[n] = now() - timing.started[(n, "forward")]
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            timing.output_bytes[n] = sum(t.nbytes for t in leaves)
            # A hook on the output tensor, not on the module: module backward hooks
            # wrap tensors in the graph, which can regroup a sum of gradients (an
            # encoder output every decoder block reads) and move the last bits.
            wanted = next((t for t in leaves if t.requires_grad), None)
            if wanted is not None:
                handles.append(wanted.register_hook(mark))

        handles.extend(
            (
                layer.register_forward_pre_hook(forward_pre),
                layer.register_forward_hook(forward_post),
            )
        )
    return handles
