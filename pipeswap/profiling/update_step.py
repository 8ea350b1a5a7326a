"""Optimizer steps over a model's own parameters, put back afterwards: what an update costs.

A profile times the optimizer's step and meters its temporaries. Stepping stand-ins of the
parameters would hold a second copy of them beside the model's; stepping aliases of the
parameters' own storage (not their version counters: autograd and pipeswap.models.state
see no write), with their values kept in host memory that no meter counts and put back
bit for bit afterwards, holds on the device what an update in training holds: the
parameters, their gradients, the optimizer's state and its temporaries.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from pipeswap.optim import OptimizerConfig
from pipeswap.profiling.meter import DeviceMeter, host_buffer
from pipeswap.profiling.step import is_allocation_error

__all__ = ["put_back_afterwards", "update_seconds", "update_temporaries"]

GRADIENT = 1e-3  # every gradient's value: a step of the usual size, no overflow


@contextmanager
def put_back_afterwards(params: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
    """Aliases of ``params`` (their storage, not their version counters or gradients), each
    with a gradient of :data:`GRADIENT`, for optimizer steps to take; afterwards every
    value is what it was (from a copy in host memory, pinned for a GPU; on meta there are
    no values to keep). The parameters' own gradients and versions are never touched."""
    aliases = [nn.Parameter(p.data, requires_grad=True) for p in params]
    kept: list[torch.Tensor | None] = []
    for alias in aliases:
        if alias.device.type == "meta":
            kept.append(None)
            continue
        nbytes = alias.numel() * alias.element_size()
        pin = alias.device.type == "cuda"
        copy = host_buffer(nbytes, pin=pin).view(alias.dtype).view(alias.shape)
        copy.copy_(alias.detach())
        kept.append(copy)
    try:
        for alias in aliases:
            alias.grad = torch.full_like(alias, GRADIENT)
        yield aliases
    finally:
        with torch.no_grad():
            for alias, held in zip(aliases, kept, strict=True):
                if held is not None:
                    alias.copy_(held)
                alias.grad = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def update_seconds(
    params: list[nn.Parameter], optimizer: str, device: torch.device, warmup: int, repeats: int
) -> float | None:
    """The median wall time of ``optimizer``'s step over ``params`` (after one step that
    makes its state and ``warmup`` more), put back afterwards; None where it does not fit."""
    try:
        with put_back_afterwards(params) as stepped:
            step = OptimizerConfig(optimizer=optimizer).build(stepped)
            seconds = []
            for repeat in range(1 + warmup + repeats):
                _sync(device)
                started = time.perf_counter()
                step.step()
                _sync(device)
                if repeat > warmup:
                    seconds.append(time.perf_counter() - started)
            del step
        return statistics.median(seconds)
    except (RuntimeError, MemoryError) as exc:
        if not is_allocation_error(exc):
            raise
        return None


def update_temporaries(params: list[nn.Parameter], optimizer: str, device: torch.device) -> int:
    """What one step of ``optimizer`` over ``params`` holds beyond the parameters, their
    gradients and its state (0 where it does not fit), put back afterwards."""
    try:
        with put_back_afterwards(params) as stepped:
            step = OptimizerConfig(optimizer=optimizer).build(stepped)
            step.step()  # makes the state
            with DeviceMeter(device, holding=(stepped, step)) as meter:
                before = meter.current
                step.step()
            del step
        return max(0, meter.peak - before)
    except (RuntimeError, MemoryError, NotImplementedError) as exc:
        if device.type != "meta" and not is_allocation_error(exc):
            raise
        return 0
