"""How many CPU threads a rank computes with: its share of what this process may use.

A process may use the CPUs of its affinity (``os.sched_getaffinity``: taskset, a
container's cpuset, a job scheduler's binding), within its cgroup's CPU quota
(``cpu.max`` of cgroup v2, ``cpu.cfs_quota_us`` of v1: ``docker --cpus``, Kubernetes
limits), and no more threads than PyTorch was given (``OMP_NUM_THREADS``, or an earlier
``torch.set_num_threads``). The ranks on one machine split the least of these; each gets
one thread at least. PyTorch alone would run as many threads as the machine has cores,
whatever the quota; and sharing cores between more threads than they hold makes every
step wait on the others (tens of times slower on a busy machine).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from pipeswap.dist.env import torchrun_env

__all__ = [
    "CGROUP_ROOT",
    "affinity_cpus",
    "cgroup_cpus",
    "rank_threads",
    "thread_share",
    "usable_cpus",
]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity; every CPU where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity (macOS)
        return os.cpu_count() or 1


def _own_cgroup() -> str:
    """This process's cgroup v2 path ("/" when it is not in one, or /proc cannot say)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:] for line in lines if line.startswith("0::")), "/") or "/"


def _quota(text: str) -> float | None:
    """CPUs a ``QUOTA PERIOD`` pair allows (None: ``max`` or -1, no quota; or unreadable)."""
    parts = text.split()
    try:
        quota, period = float(parts[0]), float(parts[1])
    except (IndexError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpus(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs this process's cgroup quota allows, rounded up; None without a quota.

    cgroup v2: the least ``cpu.max`` of its cgroup and every cgroup above it (each
    limits the ones below); v1: ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``.
    """
    limits: list[float] = []
    folder = root / _own_cgroup().strip("/")
    while True:
        text = _read(folder / "cpu.max")
        if text is not None and (found := _quota(text)) is not None:
            limits.append(found)
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    for v1 in (root / "cpu", root / "cpu,cpuacct"):
        pair = [_read(v1 / f"cpu.cfs_{name}_us") for name in ("quota", "period")]
        if None not in pair and (found := _quota(" ".join(map(str, pair)))) is not None:
            limits.append(found)
    return max(1, math.ceil(min(limits))) if limits else None


def usable_cpus() -> int:
    """The CPUs this process may keep busy: its affinity, within its cgroup's quota."""
    quota = cgroup_cpus()
    cpus = affinity_cpus()
    return max(1, min(cpus, quota) if quota is not None else cpus)


def _env_threads() -> int | None:
    """``OMP_NUM_THREADS`` when it is set to a whole number of 1 or more."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return threads if threads >= 1 else None


def thread_share(ranks: int) -> int:
    """Intra-op threads for each of ``ranks`` ranks that share what this process may use:
    the least of PyTorch's threads now (``OMP_NUM_THREADS``, an earlier
    ``torch.set_num_threads``), ``OMP_NUM_THREADS`` and :func:`usable_cpus`, split among
    them; one at least."""
    budget = min(torch.get_num_threads(), usable_cpus(), _env_threads() or math.inf)
    return max(1, int(budget) // max(1, ranks))


def rank_threads(world_size: int) -> int:
    """This rank's threads: its share among the ranks on this machine (torchrun's
    LOCAL_WORLD_SIZE, or the ``world_size`` ranks a local launch started)."""
    env = torchrun_env()
    return thread_share(env.local_ranks if env is not None else world_size)
