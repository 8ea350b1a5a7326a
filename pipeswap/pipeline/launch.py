"""Start local ranks (``--nproc``) with a rendezvous on 127.0.0.1, or join torchrun's."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.errors import PipeswapError


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None  # ranks on this machine (None: all of them)


@dataclass(frozen=True)
class LaunchResult:
    """Exit code of every rank (None: killed after the grace period) and each rank's return value."""

    exit_codes: tuple[int | None, ...]
    killed: tuple[int, ...]
    elapsed_s: float
    results: tuple[Any, ...]

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes)


def torchrun_env() -> RankEnv | None:
    """This process's rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR...), else None."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return RankEnv(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None,
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_process_group(env: RankEnv, *, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the job; every collective and transfer then fails after ``timeout_s`` of silence.

    With NCCL each rank first makes its own GPU (``local_rank``) the current device: NCCL
    needs one GPU per rank, and its collectives (object ones included) run on the current
    device, which would otherwise be GPU 0 on every rank.
    """
    if dist.is_initialized():
        return
    if backend == "nccl":
        bind_nccl_device(env)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def bind_nccl_device(env: RankEnv) -> None:
    """Make GPU ``local_rank`` current, or say why NCCL cannot give this rank a GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_ranks = env.local_world_size or env.world_size
    if count == 0:
        raise PipeswapError(
            "the NCCL backend needs CUDA GPUs, and PyTorch sees none here; train on the CPU "
            "(--device cpu), which uses gloo"
        )
    if local_ranks > count or env.local_rank >= count:
        raise PipeswapError(
            f"NCCL needs a GPU of its own for every rank, but this machine runs {local_ranks} "
            f"ranks on {count} GPU(s) (NCCL refuses two ranks on one GPU); start at most "
            f"{count} ranks per machine, or use the gloo backend, which data-parallel "
            "`pipeswap train` picks by itself when ranks share a GPU"
        )
    torch.cuda.set_device(env.local_rank)


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    grace_s: float | None = None,
) -> LaunchResult:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` fresh processes joined in one process group.

    Every rank's return value comes back (pickled through a file). When a rank exits
    non-zero, the others get ``grace_s`` (default ``timeout_s + 15``) to notice and exit
    on their own (they fail once a transfer with the dead rank errors or times out);
    any still running after that are killed and listed in ``killed``.
    """
    grace = timeout_s + 15.0 if grace_s is None else grace_s
    port = free_port()
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pipeswap-ranks-") as folder:
        procs = [
            context.Process(
                target=_rank_main,
                args=(fn, rank, nproc, port, args, folder, backend, timeout_s),
                name=f"pipeswap-rank{rank}",
            )
            for rank in range(nproc)
        ]
        start = time.monotonic()
        for proc in procs:
            proc.start()
        failed_at: float | None = None
        killed: list[int] = []
        while any(p.is_alive() for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace:
                for rank, proc in enumerate(procs):
                    if proc.is_alive():
                        proc.kill()
                        killed.append(rank)
                break
            time.sleep(0.05)
        for proc in procs:
            proc.join()
        results = []
        for rank in range(nproc):
            path = Path(folder) / f"{rank}.pkl"
            results.append(pickle.loads(path.read_bytes()) if path.exists() else None)
    return LaunchResult(
        exit_codes=tuple(None if r in killed else p.exitcode for r, p in enumerate(procs)),
        killed=tuple(killed),
        elapsed_s=time.monotonic() - start,
        results=tuple(results),
    )


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    nproc: int,
    port: int,
    args: tuple[Any, ...],
    folder: str,
    backend: str,
    timeout_s: float,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        env = torchrun_env()
        assert env is not None
        init_process_group(env, backend=backend, timeout_s=timeout_s)
        value = fn(rank, nproc, *args)
        (Path(folder) / f"{rank}.pkl").write_bytes(pickle.dumps(value))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - any failure must end this rank non-zero
        if isinstance(exc, PipeswapError):
            print(f"rank {rank}: error: {exc}", file=sys.stderr)
        else:
            print(f"rank {rank}: failed:", file=sys.stderr)
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(2 if isinstance(exc, PipeswapError) else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called...").
    os._exit(0)
