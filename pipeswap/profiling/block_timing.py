"""Each block's forward and backward time in one step of a user's loop, by hooks that leave
the autograd graph as it is."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.profiling.meter import MemoryMarks
from pipeswap.profiling.profile import StepMemory

__all__ = ["BlockTiming", "time_blocks", "watch_backward_end"]


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
    # The meter's peaks at the same edges (None: memory not read), see step_memory.
    marks: MemoryMarks | None = None
    # (when, seconds) of copies the step made in its backward that no plan's step makes
    # there (a learnt step fetching its saved tensors back): not the layers' time.
    copies: list[tuple[float, float]] = field(default_factory=list)

    # Layers whose output needed no gradient (a frozen first block): they have no backward.
    no_backward: set[str] = field(default_factory=set)
    # Layers that ran with gradients off inside the timed forward (reentrant checkpointing,
    # torch.no_grad() in the model's code): they save nothing a plan could move.
    gradless: set[str] = field(default_factory=set)
    # Set once the timed forward has returned: a later forward before the backward (an
    # evaluation of the same model, under no_grad or not) is not the one timed.
    forward_done: bool = False
    # Called once the backward has ended (the CPU's storage count stops there).
    on_backward_end: Callable[[], None] | None = None
    # time_blocks's note of the backward's first gradient (watch_backward_end).
    backward_reached: Callable[[torch.Tensor], None] | None = None

    def complete(self, names: list[str]) -> bool:
        return self.ended is not None and all(
            n in self.forward_s and (n in self.backward_started or n in self.no_backward)
            for n in names
        )

    def step_memory(self, names: list[str], start_bytes: int | None = None) -> StepMemory | None:
        """What the meter read, per layer (None without marks or when an edge was missed).

        ``start_bytes``: what the device holds at the start of a later step (CUDA: the
        optimizer state made by the first step); every reading moves by the difference.
        """
        marks = self.marks
        if marks is None:
            return None
        peaks = dict(marks.peaks)
        # A layer with no backward (a frozen prefix) comes last in the backward: the end of
        # the backward is read as the first layer's that has one.
        # (Every layer frozen, only the head trains: the whole backward is the first's.)
        later = next((m for m in names if m not in self.no_backward), names[0])
        if f"b:{later}" in peaks:
            for n in self.no_backward.intersection(names):
                peaks.setdefault(f"b:{n}", peaks[f"b:{later}"])
        wanted = [f"f:{n}" for n in names] + [f"b:{n}" for n in names] + ["turn"]
        if any(key not in peaks for key in wanted):
            return None
        shift = 0 if start_bytes is None else start_bytes - marks.start_bytes
        return StepMemory(
            start_bytes=marks.start_bytes + shift,
            forward_peak_bytes=tuple(peaks[f"f:{n}"] + shift for n in names),
            turn_peak_bytes=peaks["turn"] + shift,
            backward_peak_bytes=tuple(peaks[f"b:{n}"] + shift for n in names),
            step_peak_bytes=peaks.get("step", 0),
            meter=marks.meter.name,
        )

    def backward_s(self, names: list[str]) -> dict[str, float]:
        """Each layer's backward, less the ``copies`` made inside it (0 for a layer with
        none: it runs to the start of the previous layer's that has one, or to the end)."""
        assert self.ended is not None
        out = {}
        end = self.ended
        for n in names:
            if n not in self.backward_started:
                out[n] = 0.0
                continue
            start = self.backward_started[n]
            # Layers run backward last to first: n's ends where the one before it starts.
            copied = sum(s for when, s in self.copies if start <= when < end)
            out[n] = max(0.0, end - start - copied)
            end = start
        return out


def time_blocks(
    layers: dict[str, nn.Module], timing: BlockTiming, device: torch.device
) -> list[Any]:
    """Hooks that fill ``timing`` during the next forward and backward of ``layers``; the
    handles to remove them by (tensor hooks join the list as the forward runs).

    With ``timing.marks`` the meter is read at the same edges: a layer's forward runs to
    the next layer's start (the first layer's from the marks' start), the turn from the
    last layer's end to its backward, a layer's backward from its output's gradient to
    the next one's (the first layer's to the end of the backward)."""
    handles: list[Any] = []
    names = list(layers)
    previous = dict(zip(names[1:], names))
    following = dict(zip(names, names[1:]))

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def close(interval: str) -> None:
        if timing.marks is not None:
            timing.marks.close(interval)

    def ended() -> None:
        first = next((n for n in names if n in timing.backward_started), names[0])
        close(f"b:{first}")
        timing.ended = now()
        if timing.on_backward_end is not None:
            timing.on_backward_end()

    def timed() -> bool:  # a forward that saves nothing, or after the timed one, is not
        return torch.is_grad_enabled() and not timing.forward_done

    queued: list[bool] = []

    def note_end() -> None:  # at the backward's first gradient: note when it ends
        if not queued:
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(ended)

    def reached(grad: torch.Tensor) -> None:  # (watch_backward_end: no layer's backward)
        if not queued:
            close("turn")
            note_end()

    timing.backward_reached = reached
    for name, layer in layers.items():

        def forward_pre(m: nn.Module, a: Any, n: str = name) -> None:
            if not timed():
                if not torch.is_grad_enabled() and not timing.forward_done:
                    timing.gradless.add(n)
                return
            close(f"f:{previous.get(n, n)}")
            timing.started[(n, "forward")] = now()

        def started_backward(grad: torch.Tensor, n: str = name) -> None:
            note_end()
            if n not in timing.backward_started:
                close("turn" if n not in following else f"b:{following[n]}")
            timing.backward_started.setdefault(n, now())

        def forward_post(
            m: nn.Module, a: Any, out: Any, n: str = name, mark: Any = started_backward
        ) -> None:
            if not timed():
                return
            timing.forward_s[n] = now() - timing.started[(n, "forward")]
            if n not in following:
                close(f"f:{n}")
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            timing.output_bytes[n] = sum(t.nbytes for t in leaves)
            # A hook on the output tensor, not on the module: module backward hooks
            # wrap tensors in the graph, which can regroup a sum of gradients (an
            # encoder output every decoder block reads) and move the last bits.
            wanted = next((t for t in leaves if t.requires_grad), None)
            if wanted is not None:
                handles.append(wanted.register_hook(mark))
            elif torch.is_grad_enabled():
                timing.no_backward.add(n)

        handles.extend(
            (
                layer.register_forward_pre_hook(forward_pre),
                layer.register_forward_hook(forward_post),
            )
        )
    return handles


def watch_backward_end(timing: BlockTiming, output: Any, names: list[str]) -> list[Any]:
    """When no layer has a backward (every block frozen, the head alone trains: a linear
    probe), the backward's start and end are read off the model's ``output`` instead, so
    the step still ends (its layers save nothing); the handles to remove."""
    if timing.backward_reached is None or not set(names) <= timing.no_backward:
        return []
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    wanted = next((t for t in leaves if t.requires_grad), None)
    return [] if wanted is None else [wanted.register_hook(timing.backward_reached)]
