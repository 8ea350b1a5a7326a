"""StageMeter: what a pipeline stage's device really holds over its first steps.

A stage's swap plan keeps its modelled peak within the budget; this is the evidence it
is checked against, read by a meter that is not pipeswap's ledger
(:class:`pipeswap.profiling.meter.DeviceMeter`: CUDA's allocator, elsewhere the live
storages). Each stage meters its actions from its first through the UPDATE that ends
:func:`metered_steps` (every unit in flight at its steady state, and the optimizer's
state made), holding from the start what the stage held then: its weights, gradients
and optimizer state. A host pool (a stage that swaps) is host memory, which no meter
counts. What a stage does after an UPDATE (a held-out score, a checkpoint) is left out,
as a data-parallel rank's meter reads only its training steps.

In processes the meter is on for the rank's whole loop of actions: the receives it
posts ahead are its own buffers. In the emulator each stage has a meter of its own, on
while that stage's actions run, and a message counts on the stage it is sent to from
the moment it is sent, as the buffer a wire fills would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from pipeswap.profiling.meter import DeviceMeter
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.train_config import TrainConfig

if TYPE_CHECKING:
    from pipeswap.pipeline.executor import StageExecutor

__all__ = ["StageMeter", "metered_steps"]


def metered_steps(config: TrainConfig) -> int:
    """The steps a stage meters: until its units in flight have filled (as many steps as
    the stages span in micro-batches), then one more with the optimizer's state held."""
    pipeline = config.require_pipeline()
    fill = -(-pipeline.num_stages // pipeline.micro_batch_count)
    return min(config.steps, fill + 1)


class StageMeter:
    """The device meter of one stage (``executor``), on around its actions (:meth:`on`,
    :meth:`off`, or :meth:`action`) until the UPDATE of step ``steps - 1``."""

    def __init__(self, executor: StageExecutor, steps: int) -> None:
        weights = executor.weights
        optimizers = [weights.optimizer, *weights.shared_optimizers.values()]
        self.meter = DeviceMeter(executor.device, holding=(executor.module, optimizers))
        self.meter.reset_peak()
        self.last_step = steps - 1
        self._peak: int | None = None if steps > 0 else -1

    @property
    def metering(self) -> bool:
        return self._peak is None

    @property
    def peak_bytes(self) -> int:
        """The most the device held while metered (-1: no step was)."""
        return self.meter.peak if self._peak is None else self._peak

    def on(self) -> None:
        if self.metering:
            self.meter.resume()

    def off(self) -> None:
        self.meter.pause()

    def ran(self, action: Action) -> None:
        """``action`` has run: after the last metered step's UPDATE the meter stops."""
        if self.metering and action.kind is ActionKind.UPDATE and action.unit >= self.last_step:
            self._peak = self.meter.peak
            self.meter.pause()

    @contextmanager
    def action(self, action: Action) -> Iterator[None]:
        """Meter ``action`` (its step's end after an UPDATE, which the caller runs, is not)."""
        self.on()
        try:
            yield
        finally:
            self.off()
        self.ran(action)

    @contextmanager
    def aside(self) -> Iterator[None]:
        """Run what this stage does not hold inside (a message a wire hands to another)."""
        was = self.metering and self.meter.counting
        self.off()
        try:
            yield
        finally:
            if was:
                self.on()

    def received(self, tensors: Sequence[torch.Tensor]) -> None:
        """Count ``tensors`` as this stage's from now on (a message sent to it)."""
        if self.metering:
            self.meter.hold(*tensors)
