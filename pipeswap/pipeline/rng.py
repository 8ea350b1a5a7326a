"""RNG streams: every stage's forward of a unit draws from its own seeded stream."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["EVAL", "TRAIN", "rng_stream", "stream_seed"]

# Training forwards and held-out forwards draw from disjoint streams.
TRAIN = "train"
EVAL = "eval"


def stream_seed(seed: int, split: str, step: int, micro: int, stage: int) -> int:
    """A 63-bit seed from (config seed, split, mini-batch, micro-batch, stage).

    SHA-256, not Python's ``hash()``: the same on every rank, run and interpreter.
    """
    text = f"pipeswap.rng/1:{seed}:{split}:{step}:{micro}:{stage}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


@contextmanager
def rng_stream(
    seed: int, split: str, step: int, micro: int, stage: int, device: torch.device | str = "cpu"
) -> Iterator[None]:
    """Run the block under the stream of (seed, split, step, micro, stage); restore the caller's.

    Seeds the CPU generator, and the generator of ``device`` when it is a GPU, so dropout
    draws the same masks whichever process, schedule or interleaving runs the pass; the
    caller's generator states are put back on exit.
    """
    device = torch.device(device)
    value = stream_seed(seed, split, step, micro, stage)
    gpus = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus, device_type="cuda"):
        torch.default_generator.manual_seed(value)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(value)
        yield
