"""Process groups: backend and device per rank, joining, and the few collectives the drivers use."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.config_fields import ConfigError, require
from pipeswap.dist.env import RankEnv, torchrun_env
from pipeswap.errors import PipeswapError

__all__ = [
    "PATIENT_TIMEOUT_S",
    "agree",
    "all_gather",
    "backend_for",
    "backend_name",
    "barrier",
    "bind_nccl_device",
    "broadcast_from_rank0",
    "destroy_groups",
    "direction_groups",
    "failing_together",
    "gather_to_rank0",
    "init_process_group",
    "join_as_stages",
    "leave_process_group",
    "new_groups",
    "pair_groups",
    "rank_and_world",
    "rank_device",
    "rendezvous_error",
    "single_threaded",
]


def backend_for(kind: str, local_ranks: int) -> str:
    """NCCL when each of this machine's ``local_ranks`` ranks has a GPU of its own, else gloo.

    NCCL refuses two ranks on one GPU; gloo all-reduces CUDA tensors too (through host
    memory), so ranks sharing a GPU still train, only with slower collectives.
    """
    if kind == "cuda" and local_ranks <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def rank_device(kind: str, local_rank: int) -> torch.device:
    """The device a rank computes on: GPU ``local_rank`` (wrapping around) or the CPU."""
    if kind == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def bind_nccl_device(env: RankEnv) -> None:
    """Make GPU ``local_rank`` current, or say why NCCL cannot give this rank a GPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(
            "the NCCL backend needs CUDA GPUs, and PyTorch sees none here; train on the CPU "
            "({device} cpu), which uses gloo"
        )
    if env.local_ranks > count or env.local_rank >= count:
        raise PipeswapError(
            f"NCCL needs a GPU of its own for every rank, but this machine runs "
            f"{env.local_ranks} ranks on {count} GPU(s) (NCCL refuses two ranks on one GPU); "
            f"start at most {count} ranks per machine, or use the gloo backend, which "
            "`pipeswap train` picks by itself when ranks share a GPU"
        )
    torch.cuda.set_device(env.local_rank)


def init_process_group(env: RankEnv, *, backend: str = "gloo", timeout_s: float) -> None:
    """Join the job; every collective and transfer then fails after ``timeout_s`` of silence.

    With NCCL each rank first makes its own GPU (``local_rank``) the current device: NCCL
    needs one GPU per rank, and its collectives (object ones included) run on the current
    device, which would otherwise be GPU 0 on every rank.
    """
    if dist.is_initialized():
        return
    if backend == "nccl":
        bind_nccl_device(env)
    global _JOINS, _PATIENT
    _JOINS += 1
    timeout = timedelta(seconds=timeout_s)
    try:
        url = f"tcp://{env.master_addr}:{env.master_port}"
        store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=timeout))
        # Each join of this process has keys of its own: torchrun's agent keeps one store
        # for the whole script, where a second pipeline would read the first one's
        # (closed) addresses and fail to connect.
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"pipeswap/join{_JOINS}", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    except RuntimeError as exc:  # torch's DistError family, raised by the TCP rendezvous
        raise rendezvous_error(exc, env, timeout_s) from None
    if dist.is_initialized():  # collective, in the same order on every rank: made here, once
        _PATIENT = dist.new_group(timeout=timedelta(seconds=max(timeout_s, PATIENT_TIMEOUT_S)))


# What a rank waits for rank 0's one-sided work (a plan made under heavy contention) before
# it gives up. A rank that dies still takes the run down at once: its launcher (pipeswap's,
# or torchrun's agent) stops every other rank, so only a rank that is alive and busy is
# waited for this long; every other collective keeps the run's own timeout.
PATIENT_TIMEOUT_S = 6 * 3600.0
_PATIENT: Any = None  # the process group of those waits (None: the script made the group)
_JOINS = 0  # the process groups this process joined (each under store keys of its own)


_UNSET = "unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to launch with {nproc}"


def rendezvous_error(exc: RuntimeError, env: RankEnv, timeout_s: float) -> Exception:
    """What to tell the user when joining the job at MASTER_ADDR:MASTER_PORT failed.

    A port in use (DistNetworkError, EADDRINUSE) and nobody answering (DistStoreError,
    or a client that timed out connecting) become ConfigErrors naming the address and
    what to do (the fix names the ``nproc`` setting); any other error is returned as it is.
    """
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    lowered = text.lower()
    where = f"{env.master_addr}:{env.master_port}"
    if "eaddrinuse" in lowered or "address already in use" in lowered:
        return ConfigError(
            f"rank {env.rank} cannot open the job's rendezvous at {where}: port "
            f"{env.master_port} is already in use (another job, or one left over, holds it); "
            f"pick another MASTER_PORT, or {_UNSET}, which picks a free port"
        )
    timed_out = "timed out" in lowered or "timeout" in lowered
    if isinstance(exc, dist.DistStoreError) or timed_out or "connection refused" in lowered:
        return ConfigError(
            f"rank {env.rank} of {env.world_size} found no complete job at {where} within "
            f"{timeout_s:g} s ({first_line}); check that MASTER_ADDR and MASTER_PORT name "
            f"rank 0's machine and port and that all {env.world_size} ranks were started, "
            f"or {_UNSET}"
        )
    if isinstance(exc, dist.DistError):
        return ConfigError(
            f"rank {env.rank} could not join the job at {where} ({first_line}); check "
            f"MASTER_ADDR and MASTER_PORT, or {_UNSET}"
        )
    return exc


@contextmanager
def failing_together(close: Callable[[], None]) -> Iterator[None]:
    """Run a part of a job whose peers wait for this rank's messages. If it fails, this
    rank's process groups are closed (``close``: the job's own ones, then the default),
    so that the peers' transfers fail at once (a lost peer, which names no cause of its
    own) instead of waiting out their timeout: also where a script catches the error."""
    try:
        yield
    except BaseException as exc:
        if dist.is_initialized() and dist.get_world_size() > 1:
            rank = dist.get_rank()
            with suppress(Exception):
                close()
            with suppress(Exception):
                leave_process_group()
            exc.add_note(
                f"pipeswap: rank {rank} closed its process group so that the other "
                "ranks stop at once (they report a lost peer)"
            )
        raise


def leave_process_group() -> None:
    """Leave the job's process group if this process is in one."""
    global _PATIENT
    _PATIENT = None  # destroyed with the default group
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def single_threaded() -> Iterator[None]:
    """One intra-op thread, so CPU reductions split the same way in every process.

    The pipeline's runtime (one process per stage) and its emulator (every stage in one)
    are bit-identical on the CPU only when both reduce with the same thread count.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the initialized process group, (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def agree(failure: PipeswapError | None, world_size: int) -> None:
    """Fail on every rank if any rank failed, so no rank waits for one that is gone; the
    error is the failing rank's own (a ConfigError stays one), named by its rank."""
    failures: list[Any] = [failure]
    if world_size > 1:
        failures = [None] * world_size
        dist.all_gather_object(failures, failure)
    for rank, exc in enumerate(failures):
        if exc is None:
            continue
        if world_size == 1 or str(exc).startswith(f"rank {rank}:"):
            raise exc
        if isinstance(exc, ConfigError):
            raise ConfigError(f"rank {rank}: {exc.message}")
        raise PipeswapError(f"rank {rank}: {exc}")


def broadcast_from_rank0(value: Any, world_size: int, *, patient: bool = False) -> Any:
    """Rank 0's ``value`` on every rank (a picklable object). ``patient``: rank 0 may take
    long to make it (a plan): the others wait up to PATIENT_TIMEOUT_S, not the run's
    timeout, when pipeswap made the process group."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=_PATIENT if patient else None)
    return box[0]


def all_gather(value: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (of ``group``, default all)."""
    if world_size == 1:
        return [value]
    values: list[Any] = [None] * world_size
    dist.all_gather_object(values, value, group=group)
    return values


def gather_to_rank0(value: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0; None elsewhere."""
    if world_size == 1:
        return [value]
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def direction_groups(enabled: bool) -> tuple[Any, Any] | None:
    """Two new process groups (forward, backward transfers), or None when not ``enabled``.

    Collective: every rank must call it, in the same order.
    """
    return (dist.new_group(), dist.new_group()) if enabled else None


def new_groups(count: int) -> tuple[Any, ...]:
    """``count`` new process groups of every rank (none without a process group), each
    with its own ordering of messages and collectives.

    Collective: every rank must call it, in the same order.
    """
    return tuple(dist.new_group() for _ in range(count)) if dist.is_initialized() else ()


def pair_groups(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """A process group of the two ranks of each (src, dst) pair, one per ordered pair.

    Collective: every rank must call it with the same ``pairs`` in the same order (ranks
    outside a pair join its creation too). Returns the groups of the pairs this rank is
    in; empty without a process group or pairs.
    """
    if not pairs or not dist.is_initialized():
        return {}
    rank = dist.get_rank()
    made = {(a, b): dist.new_group(ranks=sorted((a, b))) for a, b in pairs}
    # Only the groups this rank is in: the others are no groups here (nothing to destroy).
    return {pair: group for pair, group in made.items() if rank in pair}


def destroy_groups(groups: tuple[Any, ...] | None) -> None:
    for group in groups or ():
        dist.destroy_process_group(group)


def backend_name() -> str:
    return str(dist.get_backend()) if dist.is_initialized() else "none"


def join_as_stages(stages: int, timeout_s: float) -> tuple[int, int, bool]:
    """(rank, world size, joined here) of this process, one process per pipeline stage: in
    the default process group the script made, or one joined here from torchrun's
    variables (NCCL with a GPU, else gloo; ``timeout_s`` of silence fails a transfer)."""
    rank, world = rank_and_world()
    joined = world == 1 and stages > 1
    if joined:
        env = torchrun_env()
        require(
            env is not None,
            f"a {stages}-stage pipeline runs one process per stage: start your script with "
            f"torchrun --nproc-per-node {stages}",
        )
        assert env is not None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        init_process_group(env, backend=backend, timeout_s=timeout_s)
        rank, world = rank_and_world()
    require(
        world == stages,
        f"{world} processes joined a {stages}-stage pipeline: start one per stage "
        f"(torchrun --nproc-per-node {stages})",
    )
    return rank, world, joined
