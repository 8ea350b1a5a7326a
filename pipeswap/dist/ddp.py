"""DistributedDataParallel wrapping: the one place a model is replicated over a process group."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from pipeswap.errors import PipeswapError

__all__ = ["accumulating", "replicate", "unwrap"]

_SHARDED = (FSDPModule, FullyShardedDataParallel)  # fully_shard's modules, and FSDP1's


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
    """The module a DistributedDataParallel wraps (any other module as it is); a model that
    FSDP shards is refused: FSDP gathers each layer's parameters for its forward and
    backward and frees them after, which neither offload's plans nor its meter's readings
    of a learnt step model (under fully_shard on 2 ranks, plans held 1.05-1.16x their
    budgets, and some settings crashed)."""
    sharded = next((m for m in model.modules() if isinstance(m, _SHARDED)), None)
    if sharded is not None:
        raise PipeswapError(
            f"pipeswap.offload does not support a model sharded by FSDP ({type(sharded).__name__} "
            "is): FSDP gathers and frees each layer's parameters itself, which offload's plans "
            "do not model, so a plan would not keep its budget. Replicate the model with "
            "DistributedDataParallel to use offload, or train with FSDP without it"
        )
    return model.module if isinstance(model, DistributedDataParallel) else model
