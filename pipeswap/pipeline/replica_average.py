"""The emulator's replicas: each stage's gradients averaged once every replica has them."""

from __future__ import annotations

from typing import Protocol

import torch

from pipeswap.dist.replica_groups import mean_in_order

__all__ = ["Averaging", "EmulatedReplicas", "Replica"]


class Replica(Protocol):
    """What averaging reads of a stage's replica (pipeswap.pipeline.executor.StageExecutor)."""

    @property
    def stage(self) -> int: ...
    @property
    def replica(self) -> int: ...
    def gradients(self) -> list[torch.Tensor]: ...
    def gradient_params(self) -> list[torch.nn.Parameter]: ...
    def after_average(self) -> None: ...


class Averaging(Protocol):
    """How a replicated stage averages its gradients: ``start`` before the backward that
    completes mini-batch ``step``'s gradient, the call after it (True: averaged; False:
    the emulator finishes this backward later, :meth:`Replica.after_average`)."""

    def start(self, step: int, stage: Replica) -> None: ...
    def __call__(self, step: int, stage: Replica) -> bool: ...


class EmulatedReplicas:
    """``average`` for the D replicas of a pipeline emulated in one process.

    The replicas of a stage reach the backward that completes a mini-batch's gradient one
    after another; each waits (False) until the last arrives, which averages every
    replica's gradients in replica order (as the processes do, pipeswap.dist.replica_groups)
    and finishes the waiting replicas' backward.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._arrived: dict[tuple[int, int], list[Replica]] = {}

    def start(self, step: int, stage: Replica) -> None:
        """Nothing to start: one process averages once every replica has its gradients."""

    def __call__(self, step: int, stage: Replica) -> bool:
        waiting = self._arrived.setdefault((step, stage.stage), [])
        waiting.append(stage)
        if len(waiting) < self.replicas:
            return False
        del self._arrived[(step, stage.stage)]
        ordered = sorted(waiting, key=lambda s: s.replica)
        for grads in zip(*(s.gradients() for s in ordered), strict=True):
            mean = mean_in_order(grads)
            for grad in grads:
                grad.copy_(mean)
        for other in ordered:
            if other is not stage:
                other.after_average()
        return True
