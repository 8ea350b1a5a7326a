"""A replicated pipeline's process groups, and each stage's gradients averaged over its replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist


class HasGradients(Protocol):
    def gradients(self) -> list[torch.Tensor]: ...


def mean_in_order(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The replicas' tensors added in replica order, divided by their count.

    The one arithmetic of every replicated run: the emulator adds the tensors themselves,
    the processes the gathered copies, so both give the same bits (an all-reduce would add
    in an order of its own, chunk by chunk).
    """
    total = tensors[0].clone()
    for tensor in tensors[1:]:
        total.add_(tensor)
    return total.div_(len(tensors))


class ReplicaMesh:
    """The (data, pipe) device mesh of D replicas of a K-stage pipeline: global rank
    ``d * K + k`` runs stage k of replica d. ``data`` joins stage k's replicas, ``pipe``
    the stages of one replica (torch.distributed.device_mesh)."""

    def __init__(self, replicas: int, stages: int, device_type: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.replicas, self.stages = replicas, stages
        self.mesh = init_device_mesh(
            device_type, (replicas, stages), mesh_dim_names=("data", "pipe")
        )
        rank = dist.get_rank()
        self.replica, self.stage = divmod(rank, stages)
        self.data_group: Any = self.mesh.get_group("data")
        self.pipe_group: Any = self.mesh.get_group("pipe")

    def global_rank(self, stage: int) -> int:
        """The process of ``stage`` in this rank's replica."""
        return self.replica * self.stages + stage

    def average(self, step: int, stage: HasGradients) -> bool:
        """Average ``stage``'s gradients over its replicas in place (a collective of the
        stage's replicas: every one calls it after the same backward)."""
        grads = stage.gradients()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            gathered = [torch.empty_like(flat) for _ in range(self.replicas)]
            dist.all_gather(gathered, flat, group=self.data_group)
            mean = mean_in_order(gathered)
            offset = 0
            for grad in same:
                grad.copy_(mean[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        return True
