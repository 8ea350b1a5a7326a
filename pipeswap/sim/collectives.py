"""Collectives as steps of concurrent point-to-point transfers (ring allreduce)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ring_allreduce_chunk_bytes",
    "ring_allreduce_sends",
    "ring_allreduce_steps",
    "ring_allreduce_time_s",
]


def ring_allreduce_steps(gpus: Sequence[str]) -> int:
    """Steps of a ring allreduce over ``gpus``: n-1 of reduce-scatter, n-1 of all-gather."""
    return 2 * (len(gpus) - 1)


def ring_allreduce_sends(gpus: Sequence[str]) -> list[tuple[str, str]]:
    """The (src, dst) transfers of every step: each GPU to its successor in list order.

    Every step sends one chunk of ``bytes / n`` along each pair, all at once; a step ends
    when its last transfer ends, and the next step starts then.
    """
    n = len(gpus)
    return [(gpus[i], gpus[(i + 1) % n]) for i in range(n)] if n > 1 else []


def ring_allreduce_chunk_bytes(nbytes: int, gpus: Sequence[str]) -> float:
    """Bytes each GPU sends per step (``bytes / n``; fractional when n does not divide it)."""
    return nbytes / len(gpus)


def ring_allreduce_time_s(nbytes: int, n: int, bytes_per_s: float) -> float:
    """Closed form when every ring hop has its own ``bytes_per_s`` path: 2(n-1)/n * S/B."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bytes_per_s
