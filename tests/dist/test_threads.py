"""A rank's CPU threads: its share of what the process may use, never more.

Covers: pipeswap/dist/threads.py, and its use by pipeswap/training/dp_rank.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeswap.dist import threads
from pipeswap.dist.threads import cgroup_cpus, rank_threads, thread_share, usable_cpus
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.run import train


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Put PyTorch's thread count back as it was after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _machine(
    monkeypatch: pytest.MonkeyPatch, cpus: int, *, quota: int | None = None, omp: str = ""
) -> None:
    """This process sees ``cpus`` CPUs in its affinity, a cgroup quota of ``quota`` CPUs."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: quota)
    if omp:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    else:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_cgroup_quotas_of_v2_and_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "_own_cgroup", lambda: "/")
    assert cgroup_cpus(tmp_path) is None  # no files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus 1.5
    assert cgroup_cpus(tmp_path) == 2
    # The process's own cgroup and those above it: the least quota wins.
    monkeypatch.setattr(threads, "_own_cgroup", lambda: "/job/step")
    (tmp_path / "job" / "step").mkdir(parents=True)
    (tmp_path / "job" / "step" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "job" / "cpu.max").write_text("100000 100000\n")
    assert cgroup_cpus(tmp_path) == 1
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    monkeypatch.setattr(threads, "_own_cgroup", lambda: "/")
    assert cgroup_cpus(tmp_path / "v1") == 3
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpus(tmp_path / "v1") is None


def test_the_share_respects_affinity_quota_omp_and_torch(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    torch.set_num_threads(16)
    _machine(monkeypatch, 16)
    assert usable_cpus() == 16 and thread_share(1) == 16 and thread_share(4) == 4
    _machine(monkeypatch, 1)  # taskset -c 0: one CPU
    assert thread_share(1) == 1 and thread_share(4) == 1  # one thread at least
    _machine(monkeypatch, 16, quota=2)  # docker --cpus 2 on a 16-core machine
    assert usable_cpus() == 2 and thread_share(1) == 2 and thread_share(2) == 1
    _machine(monkeypatch, 16, omp="1")  # the user's OMP_NUM_THREADS=1
    assert thread_share(1) == 1
    _machine(monkeypatch, 16, omp="not a number")
    assert thread_share(2) == 8
    _machine(monkeypatch, 16)
    torch.set_num_threads(3)  # the user's own torch.set_num_threads(3)
    assert thread_share(1) == 3


def test_a_rank_shares_among_the_ranks_of_its_machine(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    torch.set_num_threads(16)
    _machine(monkeypatch, 16)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert rank_threads(4) == 4
    # torchrun on 2 machines of 2 ranks: 2 ranks share this one.
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_threads(4) == 8


def test_a_one_rank_run_keeps_to_one_cpu_of_affinity(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    # Before: torch.set_num_threads(os.cpu_count()) over the process's affinity, 30-75x
    # slower than the user's own loop on shared cores.
    torch.set_num_threads(2)
    _machine(monkeypatch, 1)
    none = SwapConfig(policy="none")
    config = TrainConfig("gpt2-micro", batch=2, seq_len=8, steps=1, device="cpu", swap=none)
    assert train(config) is not None
    assert torch.get_num_threads() == 1


def test_a_one_rank_run_under_omp_num_threads_1_runs_one_thread(tmp_path: Path) -> None:
    script = (
        "import torch\n"
        "from pipeswap import TrainConfig, train\n"
        "from pipeswap.swap.swap_config import SwapConfig\n"
        "train(TrainConfig('gpt2-micro', batch=2, seq_len=8, steps=1, device='cpu',\n"
        "                  swap=SwapConfig(policy='none'), progress=False))\n"
        "print(torch.get_num_threads())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"


def test_ranks_started_from_python_share_the_threads_their_caller_set(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    """A started rank is a new process, blind to the caller's torch.set_num_threads: the
    launcher shares the caller's threads out and hands each rank its share."""
    from pipeswap.training import data_parallel

    _machine(monkeypatch, 8)
    torch.set_num_threads(4)
    seen: dict[str, object] = {}

    def run_ranks(fn: object, nproc: int, config: object, threads: int, **_: object) -> None:
        seen.update(nproc=nproc, threads=threads)

    monkeypatch.setattr(data_parallel, "run_ranks", run_ranks)
    config = TrainConfig("gpt2-micro", seq_len=16, steps=1, nproc=2).resolved()
    data_parallel.train_data_parallel(config)
    assert seen == {"nproc": 2, "threads": 2}  # 4 // 2, not the 8 CPUs' 4
