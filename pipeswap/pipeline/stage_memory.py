"""What a stage's executor asks of whatever keeps its saved tensors within a budget.

A pipeline stage holds the saved tensors of every unit in flight. A :class:`StageMemory`
(pipeswap.swap.runtime.unit_swapper.UnitSwapper) sees each unit's forward, each action's end and
each unit's backward's end, and moves or recomputes tensors in between; the executor
knows nothing of how. The training layer builds one per stage (``MemoryFactory``) from
the run's swap settings (pipeswap.training.pipeline_stage_swaps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["MemoryFactory", "StageMemory"]


class StageMemory(Protocol):
    def forward(
        self, unit: int, forward_loss: Callable[[], Any] | None = None
    ) -> AbstractContextManager[None]:
        """Run ``unit``'s forward inside; ``forward_loss`` is a forward of its shapes that
        keeps nothing (to name tensors before the first unit)."""
        ...

    def keep(self, tensors: Sequence[torch.Tensor]) -> None:
        """Inside a unit's forward: tensors the stage holds until the backward anyway."""
        ...

    def after_action(self, index: int) -> None: ...
    def after_backward(self, unit: int) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


# (stage index, the stage's module) -> its memory keeper, or None to keep everything.
MemoryFactory = Callable[[int, nn.Module], StageMemory | None]
