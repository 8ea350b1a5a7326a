"""The device's meter over a user's loop: a timed step, the optimizer step, a plan's first step."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.meter import DeviceMeter, MemoryMarks
from pipeswap.training.shape_plan import ShapePlan
from pipeswap.units import format_bytes

__all__ = ["LoopMeter", "say_over"]

# What a read step may hold over its plan's budget before it is said: the meter's own
# spread between equal steps, and the runtime's buffers the plans round.
_OVER = 0.02


class LoopMeter:
    """What offload reads of the device while the user's loop runs.

    On CUDA the allocator sees the whole step as the loop runs it (the user's loss and
    optimizer step included): a timed step is read at the layers' edges, and the first
    step that runs each plan as a whole, each until the next forward, when
    ``measured(plan, peak)`` learns what the plan's step held. On the CPU the storage
    count is a mode that must begin and end inside what it reads: it reads a timed step's
    forward and backward at the layers' edges and its optimizer step apart (through the
    hooks of the optimizer offload was given), and, asked to read every step
    (``watch_step``), each step's forward and backward. The count starts at the forward
    and stops at the optimizer's step (its pre-hook), at ``stats()`` or at the next
    forward, whichever comes first (a dispatch mode: one of the user's left while it is
    on ends it in its place, docs/concepts.md)."""

    def __init__(
        self,
        device: torch.device,
        holding: tuple[Any, ...],
        measured: Callable[[ShapePlan, int], None],
    ) -> None:
        self.device = device
        self.holding = holding
        self.measured = measured
        self.meter: DeviceMeter | None = None  # CUDA: reading a step, to the next forward
        self.measuring: ShapePlan | None = None  # whose first step the meter reads
        self.timing: BlockTiming | None = None  # the timed step the meter reads
        self.step_peak_due = False  # CPU: read the next optimizer step
        self.step_meter: DeviceMeter | None = None
        self.step_peak_bytes = 0  # CPU: the optimizer step's peak, when read
        self.counting_step = False  # CPU: the storage count of watch_step is on
        self.unseen_bytes = 0  # CPU: what the step holds that the count cannot see
        self.serving: ShapePlan | None = None  # the plan of the step watch_step reads
        self._stops: list[Any] = []  # what takes the CPU's count off (see _count)

    def time(
        self, timing: BlockTiming, *, optimizer_hooked: bool, holding: tuple[Any, ...] = ()
    ) -> None:
        """Read a timed step at its layers' edges; on the CPU its optimizer step apart (the
        count, which stops there, counts from the start what ``holding``, the call, holds)."""
        if self.device.type == "cuda":
            self.meter = DeviceMeter(self.device)
        else:
            self.step_peak_due, self.step_peak_bytes = optimizer_hooked, 0
            self.meter = DeviceMeter(self.device, holding=(*self.holding, *holding))
            self._count(0)
            timing.on_backward_end = self.meter.stop_seeing  # its end: taken off later
        timing.marks = MemoryMarks(self.meter)
        self.timing = timing

    def watch(self, planned: ShapePlan) -> None:
        """Read the allocator over the first step that runs ``planned`` (to the next forward)."""
        self.meter = DeviceMeter(self.device)
        self.meter.reset_peak()
        self.measuring = planned

    def watch_step(
        self,
        holding: tuple[Any, ...] = (),
        unseen_bytes: int = 0,
        planned: ShapePlan | None = None,
    ) -> None:
        """Read the device over this step too, for stats(): CUDA's allocator to the next
        forward; on the CPU the storage count over its forward and backward, with what
        ``holding`` holds (the call) counted from the start and ``unseen_bytes`` (optimizer
        state the count cannot see) added. A step that runs ``planned`` and holds more than
        its budget is said in a warning, once a plan (:meth:`stop`)."""
        if self.meter is not None:
            return
        self.serving = planned
        if self.device.type == "cuda":
            self.meter = DeviceMeter(self.device)
            self.meter.reset_peak()
            return
        self.meter = DeviceMeter(self.device, holding=(*self.holding, *holding))
        self._count(unseen_bytes)

    def _count(self, unseen_bytes: int) -> None:
        """Start the CPU's storage count, a mode left on into the caller's code: taken off
        at the next optimizer step of any optimizer (a global hook: the step is outside
        every backward, where a mode taken off stays off), at stats(), at the next forward,
        or when this meter is collected (a loop that ends with a learnt step)."""
        assert self.meter is not None
        self.meter.resume()
        self.counting_step, self.unseen_bytes = True, unseen_bytes
        this = weakref.ref(self)  # (the global hook must not keep this meter alive)

        def at_optimizer_step(*_: Any) -> None:
            meter = this()
            if meter is not None:
                meter.end_count()

        self._stops = [
            register_optimizer_step_pre_hook(at_optimizer_step),
            weakref.finalize(self, self.meter.pause),
        ]

    def end_count(self) -> None:
        """CPU: the storage count stops here (what it read is kept)."""
        if self.counting_step and self.meter is not None:
            self.meter.pause()
        for stop in self._stops:
            if isinstance(stop, RemovableHandle):
                stop.remove()
            else:
                stop.detach()
        self._stops = []

    def step_peak_so_far(self) -> int | None:
        """The most the device held since this step's forward began (after its backward:
        the forward and backward; after its optimizer step: all of it, on CUDA). None for a
        step not watched, and for a timed step (its meter is read, and reset, at the
        layers' edges)."""
        if self.meter is None or self.timing is not None:
            return None
        if self.counting_step:
            return self.meter.peak + self.unseen_bytes
        return self.meter.peak if self.device.type == "cuda" else None

    def optimizer_step(self, starting: bool) -> None:
        """The optimizer's step hooks: on the CPU the steps after a timed one, to the next
        forward, are read (every optimizer the loop steps: the most any held), and a
        watched step's count stops before them."""
        if starting:
            self.end_count()
        if starting and self.step_peak_due and self.step_meter is None:
            meter = DeviceMeter(self.device, holding=self.holding)
            meter.__enter__()
            self.step_meter = meter
        elif not starting and self.step_meter is not None:
            meter, self.step_meter = self.step_meter, None
            meter.__exit__(None, None, None)
            self.step_peak_bytes = max(self.step_peak_bytes, meter.peak)

    def stop(self, holding: tuple[Any, ...] = (), unseen_bytes: int = 0) -> int | None:
        """End the step the meter reads (at the next forward, so the optimizer step counts):
        a timed step's last interval, or a plan's first step, checked against its budget.
        Returns what the device holds now (None without a meter; on the CPU, for a timed
        step only: what the model and optimizers hold now, with ``holding`` (the next call)
        and ``unseen_bytes``, optimizer state the count cannot see)."""
        self.end_count()
        self.step_peak_due = False  # the optimizer steps after a timed one were read
        watched = self.step_peak_so_far()
        meter, self.meter = self.meter, None
        serving, self.serving = self.serving, None
        if watched is not None and serving is not None:
            say_over(serving, watched)
        if meter is None:
            return None
        timing, self.timing = self.timing, None
        counted, self.counting_step = self.counting_step, False
        if counted and timing is None:  # nothing else reads the CPU between forwards
            return None
        if timing is not None and timing.marks is not None:
            timing.marks.close("step")
            if counted:  # the count stopped at the backward's end: the step read apart
                timing.marks.peaks["step"] = self.step_peak_bytes
        held, peak = meter.current, meter.peak
        if counted:  # what the next step starts with, counted afresh (CUDA's allocator's)
            start = DeviceMeter(self.device, holding=(*self.holding, *holding))
            held = start.current + unseen_bytes
        planned, self.measuring = self.measuring, None
        if planned is not None:
            self.measured(planned, peak)
        return held

    def peak_so_far(self, planned: ShapePlan) -> int | None:
        """The measured peak of ``planned``'s first step, or the most so far while it runs."""
        measured = planned.measured_peak_bytes
        if measured is None and self.measuring is planned and self.meter is not None:
            measured = self.meter.peak
        return measured


def say_over(planned: ShapePlan, peak: int) -> None:
    """Warn, once a plan, of a step of the user's that held more than ``planned``'s budget:
    what the plan's profile did not see (it names each layer's saved tensors and working
    sets in one forward and backward)."""
    budget = planned.budget_bytes
    if planned.said_over or planned.recomputes_all or peak <= budget * (1 + _OVER):
        return
    planned.said_over = True
    warnings.warn(
        f"pipeswap.offload: a step held {format_bytes(peak)}, {peak / budget - 1:.0%} over "
        f"the run's budget of {format_bytes(budget)}: it holds what its plan did not see, "
        "as a second backward through the graph (a gradient penalty, create_graph=True), "
        "a wrapper's own buffers, or state a recomputed layer keeps past its forward "
        "outside its own modules (a tensor carrying the graph, which holds its re-run's "
        "saved tensors until the next forward) do; give a smaller budget to keep such "
        "steps within the device",
        RuntimeWarning,
        stacklevel=4,
    )
