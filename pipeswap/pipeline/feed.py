"""A pipeline fed one mini-batch per call: the batches handed over, and where each call stops."""

from __future__ import annotations

import torch

from pipeswap.schedule.actions import Action, ActionKind

__all__ = ["FedBatches", "step_ends", "step_of"]


class FedBatches:
    """The mini-batches handed to a pipeline one step at a time (pipeswap.Pipeline.step):
    what its first and last stages read, micro-batch by micro-batch.

    Micro-batches hold ``micro_batch_size`` samples, or with ``micro_batches`` each
    mini-batch is cut into that many, whatever its size (a short last batch)."""

    def __init__(self, micro_batch_size: int = 0, *, micro_batches: int | None = None) -> None:
        self.size, self.count = micro_batch_size, micro_batches
        self.batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, step: int, inputs: torch.Tensor, target: torch.Tensor) -> None:
        """Hand over mini-batch ``step`` in place of the last one: a stage reads step t's
        batch only during the call that hands it over (:func:`step_ends`)."""
        self.batches = {step: (inputs, target)}

    def micro(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, target = self.batches[step]
        size = self.size if self.count is None else len(inputs) // self.count
        part = slice(index * size, (index + 1) * size)
        return inputs[part], target[part]


def step_ends(actions: tuple[Action, ...], micro_batches: int, steps: int) -> list[int]:
    """Where one rank's actions stop after each call: ``ends[t]`` is the index of its first
    action of a later mini-batch than ``t``; after the last step, the end of its actions.

    A stage's forward of mini-batch t (the only pass that reads its data) comes before
    its first action of t + 1, so the call of step t runs it. A stage blocked on a
    transfer a peer makes in a later call waits for it there: the stops only add waits
    for the caller's own next call, so the schedule's order stays deadlock-free.
    """
    ends, i = [], 0
    for t in range(steps - 1):
        while i < len(actions) and step_of(actions[i], micro_batches) <= t:
            i += 1
        ends.append(i)
    ends.append(len(actions))
    return ends


def step_of(action: Action, micro_batches: int) -> int:
    """The mini-batch an action belongs to (UPDATE's unit is its step)."""
    return action.unit if action.kind is ActionKind.UPDATE else action.unit // micro_batches
