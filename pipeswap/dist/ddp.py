"""DistributedDataParallel wrapping: the one place a model is replicated over a process group."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["accumulating", "replicate", "unwrap"]


def replicate(
    model: nn.Module, device: torch.device, bucket_bytes: int, world_size: int
) -> nn.Module:
    """``model`` under DistributedDataParallel with ``bucket_bytes`` gradient buckets (the
    model itself with one rank). The process group must already be initialised."""
    if world_size == 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_bytes / 2**20)


def accumulating(network: nn.Module, sync: bool) -> AbstractContextManager[object]:
    """Inside: the backward accumulates gradients locally (no all-reduce) unless ``sync``."""
    if sync or not isinstance(network, DistributedDataParallel):
        return nullcontext()
    return network.no_sync()


def unwrap(model: nn.Module) -> nn.Module:
    """The module a DistributedDataParallel wraps (any other module as it is)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
