"""One rank's measurements of this machine: host copies, collectives, compute under contention.

Every rank of the process group runs :func:`measure_rank` at once; each measurement is
taken by rank 0 alone (the others wait at a barrier) and by every rank together. What the
numbers mean on each device:

- copies: on CUDA, host to device and back through PCIe, from pinned and pageable host
  memory, each direction alone and both at once (two streams), timed with CUDA events;
  on the CPU, memory copies between two host buffers (what a swap costs there), both
  "directions" at once being two copies in two threads;
- collectives: ``all_reduce`` of float32 tensors and a send/receive between neighbouring
  ranks, by size, for the backend in use (gloo, NCCL);
- compute: a fixed loop of matrix products by rank 0 alone with every thread it has (as a
  profile is measured) and by every rank at once with its share of the cores (as a run
  computes), whose ratio is how much slower a rank of a run computes than its profile says
  (ranks sharing a CPU's cores; on a GPU each rank has its own, so close to 1); and, one
  thread per rank as pipeline stages compute, the same products interleaved with
  send/receive exchanges between rank pairs, less the exchanges' own time, over the
  products alone: how much a stage's compute slows while its transfers go on (gloo's
  transport threads share the cores; NCCL moves data on the GPU's own engines); and the
  products with one thread by rank 0 alone and by every rank at once: how much a
  one-thread stage slows when more ranks than cores compute.

``nvbandwidth`` measures the copies more thoroughly (every engine and pattern) and
``nccl-tests`` the collectives (bus bandwidth by size); these are what a training run of
PyTorch itself sees.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.dist.threads import thread_share

__all__ = [
    "COLLECTIVE_SIZES",
    "COPY_BYTES",
    "QUICK_COLLECTIVE_SIZES",
    "QUICK_COPY_BYTES",
    "measure_rank",
]

# Sizes (bytes) of the collective measurements, and of the copies.
COLLECTIVE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
QUICK_COLLECTIVE_SIZES = (64 << 10, 4 << 20)
COPY_BYTES = 64 << 20
QUICK_COPY_BYTES = 4 << 20
_MATMUL = 256
# The compute-with-transfers measurement: this many rounds of products and an exchange.
_EXCHANGES = 40
_EXCHANGE_BYTES = 256 << 10


def measure_rank(rank: int, world: int, quick: bool = False) -> dict[str, Any]:
    """This rank's measurements (rank 0's alone ones included); every rank calls it."""
    device = _device()
    repeats = 2 if quick else 5
    copy_bytes = QUICK_COPY_BYTES if quick else COPY_BYTES
    sizes = QUICK_COLLECTIVE_SIZES if quick else COLLECTIVE_SIZES
    out: dict[str, Any] = {"rank": rank, "device": str(device), "backend": dist.get_backend()}
    # Compute alone as a profile is measured (one process, every thread it has), then as
    # a run computes: every rank at once, each with its share of the cores on a CPU
    # (pipeswap.training.dp_rank), which every later measurement keeps.
    dist.barrier()
    alone = _compute_s(device, repeats) if rank == 0 else None
    if device.type == "cpu":
        torch.set_num_threads(thread_share(world))
    dist.barrier()
    out["compute"] = {"alone": alone, "together": _compute_s(device, repeats)}
    out["copy"] = {}
    for kind in _copy_kinds(device):

        def copy_rate(kind: str = kind) -> float:
            return _copy_rate(kind, device, copy_bytes, repeats)

        out["copy"][kind] = _alone_and_together(rank, copy_rate)
    out["allreduce"] = [[size, _allreduce_s(size, device, repeats)] for size in sizes]
    out["p2p"] = [[size, _p2p_s(rank, world, size, device, repeats)] for size in sizes]
    out["compute"]["with_p2p"] = _p2p_slowdown(rank, world, device, repeats)
    out["compute"]["one_thread"] = _one_thread(rank, device, repeats)
    return out


def _one_thread(rank: int, device: torch.device, repeats: int) -> dict[str, float | None]:
    """The products with one thread (as a pipeline stage computes, and its profile is
    measured), in paired rounds: by rank 0 alone, then by every rank at once (more ranks
    than cores share them); the medians of the rounds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    alone: list[float] = []
    together: list[float] = []
    try:
        for _ in range(repeats + 3):
            dist.barrier()
            if rank == 0:
                alone.append(_compute_s(device, 0))
            dist.barrier()
            together.append(_compute_s(device, 0))
    finally:
        torch.set_num_threads(threads)
    dist.barrier()
    return {
        "alone": statistics.median(alone[1:]) if alone else None,
        "together": statistics.median(together[1:]),
    }


def _device() -> torch.device:
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _alone_and_together(rank: int, measure: Callable[[], float]) -> dict[str, float | None]:
    """``measure()`` on rank 0 while the others wait, then on every rank at once."""
    dist.barrier()
    alone = measure() if rank == 0 else None
    dist.barrier()
    together = measure()
    dist.barrier()
    return {"alone": alone, "together": together}


def _copy_kinds(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("h2d-pinned", "d2h-pinned", "both-pinned", "h2d-pageable", "d2h-pageable")
    return ("h2d-pageable", "d2h-pageable", "both-pageable")


def _copy_rate(kind: str, device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes per second of the copy ``kind`` (both directions: their sum)."""
    pinned = kind.endswith("pinned") and device.type == "cuda"
    host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
    near = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]
    pairs = {"h2d": [(near[0], host[0])], "d2h": [(host[0], near[0])]}
    pairs["both"] = pairs["h2d"] + [(host[1], near[1])]
    chosen = pairs[kind.split("-")[0]]
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        best = min(best, _timed_copies(chosen, device))
    return len(chosen) * nbytes / best


def _timed_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    if device.type == "cuda":
        streams = [torch.cuda.Stream() for _ in pairs]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for stream, (dst, src) in zip(streams, pairs, strict=True):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    threads = [threading.Thread(target=dst.copy_, args=(src,)) for dst, src in pairs]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began


def _compute_s(device: torch.device, repeats: int) -> float:
    """Seconds of 20 products of two 256 x 256 float32 matrices (the fastest of repeats + 1;
    one round with ``repeats`` 0)."""
    a = torch.randn(_MATMUL, _MATMUL, device=device)
    b = torch.randn(_MATMUL, _MATMUL, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        _sync(device)
        began = time.perf_counter()
        for _ in range(20):
            a = torch.tanh(a @ b)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return best


def _p2p_slowdown(rank: int, world: int, device: torch.device, repeats: int) -> float | None:
    """One thread's compute interleaved with exchanges with its partner rank, less the
    exchanges alone, over the compute alone (None on a rank with no partner)."""
    partner = rank + 1 if rank % 2 == 0 else rank - 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(_MATMUL, _MATMUL, device=device)
    b = torch.randn(_MATMUL, _MATMUL, device=device)
    message = torch.ones(_EXCHANGE_BYTES // 4, device=device)
    received = torch.empty_like(message)

    def compute() -> None:
        for _ in range(4):
            torch.tanh(a @ b)

    def exchange() -> None:
        works = [dist.isend(message, partner), dist.irecv(received, partner)]
        for work in works:
            assert work is not None
            work.wait()

    def both() -> None:
        compute()
        exchange()

    def timed(body: Callable[[], None]) -> float:
        dist.barrier()
        _sync(device)
        began = time.perf_counter()
        for _ in range(_EXCHANGES):
            body()
        _sync(device)
        return time.perf_counter() - began

    # Paired rounds, the median of their ratios: the three timings of a round are taken
    # back to back, so a machine that changes speed between rounds (a shared one does)
    # moves all three alike.
    ratios = []
    try:
        for _ in range(repeats + 3):
            if partner >= world:
                for _ in range(3):
                    dist.barrier()
                continue
            alone, talking, mixed = timed(compute), timed(exchange), timed(both)
            ratios.append((mixed - talking) / alone)
    finally:
        torch.set_num_threads(threads)
    if partner >= world:
        return None
    return max(1.0, statistics.median(ratios[1:]))


def _allreduce_s(nbytes: int, device: torch.device, repeats: int) -> float:
    tensor = torch.ones(max(1, nbytes // 4), device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        dist.barrier()
        _sync(device)
        began = time.perf_counter()
        dist.all_reduce(tensor)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return best


def _p2p_s(rank: int, world: int, nbytes: int, device: torch.device, repeats: int) -> float | None:
    """A send from each even rank to the next odd one (None on a rank with no partner)."""
    partner = rank + 1 if rank % 2 == 0 else rank - 1
    tensor = torch.ones(max(1, nbytes // 4), device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        dist.barrier()
        if partner >= world:
            continue
        _sync(device)
        began = time.perf_counter()
        if rank % 2 == 0:
            dist.send(tensor, partner)
        else:
            dist.recv(tensor, partner)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return None if partner >= world else best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
