"""Where this process sits in a job: torchrun's environment variables, a free local port."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError

__all__ = ["RankEnv", "free_port", "local_rank_of", "torchrun_env"]


@dataclass(frozen=True)
class RankEnv:
    """Where this process sits in the job (torchrun's environment variables)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int | None = None  # ranks on this machine (None: all of them)

    @property
    def local_ranks(self) -> int:
        """How many ranks share this machine (and so its GPUs)."""
        return self.local_world_size or self.world_size


def torchrun_env() -> RankEnv | None:
    """This process's rank under torchrun (RANK, WORLD_SIZE, MASTER_ADDR...), else None.

    Values that are not whole numbers or do not fit together (RANK >= WORLD_SIZE, a
    negative rank, a port outside 1..65535) are refused with a PipeswapError naming the
    variables: most often a stale environment left over from an earlier torchrun job.
    It is a ConfigError: its fix names the ``nproc`` setting.
    """
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank = _whole("RANK")
    world_size = _whole("WORLD_SIZE")
    local_rank = _whole("LOCAL_RANK") if "LOCAL_RANK" in env else rank
    local_world_size = _whole("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None
    master_port = _whole("MASTER_PORT") if "MASTER_PORT" in env else 29500
    if world_size < 1:
        raise _stale(f"WORLD_SIZE={world_size}, but a job needs at least 1 rank")
    if not 0 <= rank < world_size:
        raise _stale(f"RANK={rank} but WORLD_SIZE={world_size}")
    if local_world_size is not None and not 1 <= local_world_size <= world_size:
        raise _stale(f"LOCAL_WORLD_SIZE={local_world_size} but WORLD_SIZE={world_size}")
    local_limit = world_size if local_world_size is None else local_world_size
    if not 0 <= local_rank < local_limit:
        named = "WORLD_SIZE" if local_world_size is None else "LOCAL_WORLD_SIZE"
        raise _stale(f"LOCAL_RANK={local_rank} but {named}={local_limit}")
    if not 1 <= master_port <= 65535:
        raise _stale(f"MASTER_PORT={master_port} is not a TCP port (1 to 65535)")
    return RankEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=master_port,
        local_world_size=local_world_size,
    )


def _whole(name: str) -> int:
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise _stale(f"{name}={text!r} is not a whole number") from None


def _stale(problem: str) -> ConfigError:
    """The refusal of a torchrun environment that cannot be a real job's."""
    names = ["RANK", "WORLD_SIZE"]
    names += [n for n in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if n in os.environ]
    return ConfigError(
        f"{problem}: a stale torchrun environment? unset {', '.join(names)}, MASTER_ADDR "
        "and MASTER_PORT to launch with {nproc}"
    )


def local_rank_of(rank: int) -> int:
    """This process's rank on its machine: torchrun's LOCAL_RANK, else ``rank`` (one machine)."""
    env = torchrun_env()
    return env.local_rank if env is not None else rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
