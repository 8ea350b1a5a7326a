"""A replicated pipeline's process groups, and each stage's gradients averaged over its replicas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["BUCKET_BYTES", "HasGradients", "ReplicaMesh", "buckets_of", "mean_in_order"]


# DDP's default bucket (bucket_cap_mb=25): a stage's gradients gather in buckets this big.
BUCKET_BYTES = 25 * 2**20


class HasGradients(Protocol):
    def gradient_params(self) -> list[torch.nn.Parameter]: ...


class _Bucket:
    """Parameters whose gradients gather together, and the gather once it started."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.waiting = len(params)
        self.grads: list[torch.Tensor] = []
        self.gathered: list[torch.Tensor] = []
        self.work: Any = None


def buckets_of(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
    """``params`` in reverse order (the order the backward completes them, last layer
    first), cut into buckets of one dtype of at most ``bucket_bytes`` (at least one each)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or buckets[-1][0].dtype != p.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return [_Bucket(b) for b in buckets]


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

    def __init__(
        self, replicas: int, stages: int, device_type: str, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.replicas, self.stages = replicas, stages
        self.bucket_bytes = bucket_bytes
        self._buckets: list[_Bucket] = []
        self._hooks: list[Any] = []
        self.gathered_in_backward = 0  # buckets that started gathering before the backward ended
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

    def start(self, step: int, stage: HasGradients) -> None:
        """Before the backward that completes mini-batch ``step``'s gradient: each bucket
        of ``stage``'s gradients starts gathering from the replicas as soon as that
        backward has accumulated all of it, overlapping the rest of the backward (as DDP)."""
        self._buckets = buckets_of(stage.gradient_params(), self.bucket_bytes)
        for bucket in self._buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._ready(bucket)))

    def _ready(self, bucket: _Bucket) -> Any:
        def hook(param: torch.nn.Parameter) -> None:
            bucket.waiting -= 1
            if bucket.waiting == 0:
                self.gathered_in_backward += 1
                self._gather(bucket)

        return hook

    def _gather(self, bucket: _Bucket) -> None:
        bucket.grads = [p.grad for p in bucket.params if p.grad is not None]
        if not bucket.grads:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        bucket.gathered = [torch.empty_like(flat) for _ in range(self.replicas)]
        bucket.work = dist.all_gather(bucket.gathered, flat, group=self.data_group, async_op=True)

    def __call__(self, step: int, stage: HasGradients) -> bool:
        """Average ``stage``'s gradients over its replicas in place (a collective of the
        stage's replicas: every one calls it after the same backward): wait for the
        buckets' gathers (start the ones the backward left incomplete), then add each in
        replica order."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if not self._buckets:  # no start(): one exchange of every gradient now
            self._buckets = buckets_of(stage.gradient_params(), self.bucket_bytes)
        for bucket in self._buckets:
            if bucket.work is None:
                self._gather(bucket)
        for bucket in self._buckets:
            if bucket.work is None:
                continue
            bucket.work.wait()
            mean = mean_in_order(bucket.gathered)
            offset = 0
            for grad in bucket.grads:
                grad.copy_(mean[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._buckets = []
        return True
