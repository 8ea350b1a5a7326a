"""Where this process sits in a job: torchrun's environment variables, a free local port."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


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


def local_rank_of(rank: int) -> int:
    """This process's rank on its machine: torchrun's LOCAL_RANK, else ``rank`` (one machine)."""
    env = torchrun_env()
    return env.local_rank if env is not None else rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
