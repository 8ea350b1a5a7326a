"""Launching ranks: one process, local spawn, and one error that names the failing rank.

Covers: pipeswap/dist/launch.py, pipeswap/dist/faults.py.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from support import pipeline_run

from pipeswap.dist.faults import FAULT_ENV, fault_hook
from pipeswap.dist.launch import RankFailedError, run_ranks, spawn
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.runtime import run_stage_rank
from pipeswap.train_config import TrainConfig


def _train(rank: int, world: int, config: TrainConfig) -> float | None:
    result = run_stage_rank(config)
    return None if result is None else result.losses[-1]


def _echo(rank: int, world: int, value: int) -> tuple[int, int, int]:
    return rank, world, value


def _refuse_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise PipeswapError("the budget is too small; pass --gpu-memory 2GiB")
    return rank


@pytest.mark.dist
def test_dead_rank_makes_the_others_exit_non_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    timeout = 10.0
    monkeypatch.setenv(FAULT_ENV, "2:3")  # rank 2 kills itself after its step 3
    config = pipeline_run(
        "gpt2-micro",
        (1, 1, 1, 1),
        batch=4,
        seq_len=16,
        steps=50,
        schedule="async-1f1b",
        timeout_s=timeout,
    )
    launched = spawn(_train, 4, config, timeout_s=timeout, grace_s=timeout + 20)
    assert launched.exit_codes[2] == -signal.SIGKILL and launched.first_failed == 2
    # Every survivor noticed by itself (none had to be killed) and failed.
    assert launched.killed == ()
    assert all(code not in (0, None) for code in launched.exit_codes)
    # Start-up (a few seconds) plus at most one timeout, far from a hang.
    assert launched.elapsed_s < timeout + 15
    with pytest.raises(RankFailedError, match="^rank 2 was killed by SIGKILL") as info:
        launched.raise_failure()
    assert info.value.exit_status == 1
    # It printed nothing: the message does not send the user to an output above.
    assert "output is above" not in str(info.value) and "dmesg" in str(info.value)


@pytest.mark.dist
def test_run_ranks_returns_rank_0s_value_and_names_a_refusing_rank() -> None:
    assert run_ranks(_echo, 1, 7, device="cpu", timeout_s=60) == (
        0,
        1,
        7,
    )  # one rank: this process, no group
    assert run_ranks(_echo, 2, 7, device="cpu", timeout_s=60) == (0, 2, 7)
    with pytest.raises(PipeswapError, match=r"^rank 1: the budget is too small") as info:
        run_ranks(_refuse_on_rank_1, 2, device="cpu", timeout_s=60)
    assert not isinstance(info.value, RankFailedError)  # bad input: the CLI exits 2
    with pytest.raises(PipeswapError, match="nproc is 0"):
        run_ranks(_echo, 0, 7, device="cpu", timeout_s=60)


def test_the_fault_hook_is_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert fault_hook(0) is None
    monkeypatch.setenv(FAULT_ENV, "1:4")
    assert fault_hook(0) is None and fault_hook(1) is not None
    monkeypatch.setenv(FAULT_ENV, "one")
    with pytest.raises(PipeswapError, match="RANK:STEP"):
        fault_hook(0)


def _refuse_on_rank_0_while_rank_1_waits(rank: int, world: int) -> int:
    if rank == 0:
        raise PipeswapError("cannot read checkpoint ck/rank-0.pt; start afresh")
    torch.distributed.all_reduce(torch.zeros(1))  # rank 0 never joins: its exit ends this
    return rank


def _crash_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise RuntimeError("boom\nmore detail on a second line")
    return rank


@pytest.mark.dist
def test_a_refusal_is_said_once_by_the_launcher(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PipeswapError, match=r"^rank 0: cannot read checkpoint"):
        run_ranks(_refuse_on_rank_0_while_rank_1_waits, 2, device="cpu", timeout_s=60)
    # Before: rank 1 printed gloo's RuntimeError ("Connection closed by peer ... GLHF!"),
    # then each rank a line of its own, and the caller printed the refusal once more. The
    # refusing rank's words reach the caller alone; a rank that lost its peers is never
    # the cause (the launcher names the rank that failed first), so it says nothing.
    assert capfd.readouterr().err == ""


@pytest.mark.dist
def test_a_crashed_rank_is_one_line_unless_debugging(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RankFailedError, match=r"^rank 1 exited with status 1"):
        run_ranks(_crash_on_rank_1, 2, device="cpu", timeout_s=60)
    lines = set(capfd.readouterr().err.splitlines())
    crashed = "rank 1: crashed: RuntimeError: boom (set PIPESWAP_DEBUG=1 for the traceback)"
    lost = "rank 0: stopped: it lost its peers: another rank ended first"
    # Rank 0 waits for rank 1 at the end, and may see it go before the launcher stops it.
    assert lines in ({crashed}, {crashed, lost})
    monkeypatch.setenv("PIPESWAP_DEBUG", "1")
    with pytest.raises(RankFailedError):
        run_ranks(_crash_on_rank_1, 2, device="cpu", timeout_s=60)
    err = capfd.readouterr().err
    assert "Traceback" in err and "more detail on a second line" in err


def _stop_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive but stuck: it never ends on its own
    torch.distributed.all_reduce(torch.zeros(1))
    return rank


@pytest.mark.dist
def test_a_stopped_rank_ends_the_run_one_notice_period_after_the_timeout() -> None:
    timeout = 10.0
    launched = spawn(_stop_rank_1, 2, timeout_s=timeout)
    assert launched.exit_codes[0] not in (0, None) and launched.killed == (1,)
    # Rank 0 times out, then rank 1 gets 15 s (before: the timeout plus 15 s more).
    assert timeout + 15 <= launched.elapsed_s < timeout + 15 + 6


def test_ctrl_c_again_while_the_ranks_wind_down_kills_them_before_it_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pipeswap.dist.launch as launch

    class Rank:
        sentinel = object()

        def __init__(self) -> None:
            self.alive, self.killed = True, False

        def is_alive(self) -> bool:
            return self.alive

        def terminate(self) -> None:  # a rank busy in its step does not end on SIGTERM
            pass

        def kill(self) -> None:
            self.alive, self.killed = False, True

        def join(self) -> None:
            pass

    def second_ctrl_c(*_: object) -> list[object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "wait", second_ctrl_c)
    ranks = [Rank(), Rank()]
    with pytest.raises(KeyboardInterrupt):
        launch._stop(ranks, 30.0, [], {})
    assert all(rank.killed for rank in ranks)  # none is left to finish its step


def test_a_launcher_stopped_by_ctrl_c_names_sigint_where_its_ranks_saw_sigterm() -> None:
    """The launcher passes Ctrl-C on to its ranks as SIGTERM; their word ("stopped by
    SIGTERM after step 32") named the signal they got, not the user's."""
    from pipeswap.dist.launch import LaunchResult
    from pipeswap.dist.signals import LauncherInterrupted

    launched = LaunchResult(
        exit_codes=(130, 0),
        killed=(),
        elapsed_s=1.0,
        results=(None, None),
        messages=("stopped by SIGTERM after step 32; its checkpoint is in ck", None),
        interrupted=signal.SIGINT,
    )
    with pytest.raises(LauncherInterrupted, match="^stopped by SIGINT after step 32; its"):
        launched.raise_failure()
