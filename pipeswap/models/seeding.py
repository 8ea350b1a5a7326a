"""seeded(): draw a model's initial weights from a seed without touching anyone's RNG."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["seeded"]


@contextmanager
def seeded(device: torch.device, seed: int | None) -> Iterator[None]:
    """Seed the init on ``device`` without disturbing anyone else's random state."""
    if device.type == "meta" or seed is None:
        yield
        return
    cuda_devices = []
    if device.type == "cuda":
        cuda_devices = [torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=cuda_devices):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda_devices:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield
