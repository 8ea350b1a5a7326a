"""Pipeline checkpoints: consistent cuts, and resuming bit-identically, emulator and runtime.

Covers: pipeswap/pipeline/snapshot.py, pipeswap/checkpoint.py (the pipeline side).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from runtime_check import train_checkpointed
from support import pipeline_run

from pipeswap.checkpoint import (
    CheckpointPlan,
    RunStopped,
    check_identity,
    latest_complete,
    step_dir,
)
from pipeswap.config_fields import replace_fields
from pipeswap.dist.faults import FAULT_ENV
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.emulator import Emulator, pipeline_schedule
from pipeswap.pipeline.snapshot import crossing_messages, cut_index

BASE = pipeline_run(
    "gpt2-micro",
    (1, 1, 1, 1),
    schedule="async-1f1b",
    weights="spectrain",
    batch=4,
    seq_len=16,
    steps=9,
    lr=0.05,
)
MODES = [
    ("async-1f1b", "stale", "sgd", 1),
    ("async-1f1b", "stash", "sgd", 1),
    ("async-1f1b", "spectrain", "sgd", 1),
    ("async-1f1b", "predict-adam", "adam", 1),
    ("1f1b", "stale", "adamw", 2),
    ("2bw", "stash", "sgd", 2),
    ("async-1f1b", "nesterov", "adamw", 1),
    ("async-1f1b", "nesterov", "sgd", 1),
]


def _plan(folder: Path, world: int, every: int = 4) -> CheckpointPlan:
    return CheckpointPlan(str(folder), every, {"test": "snapshot"}, world)


def test_async_cut_keeps_the_activations_the_next_stage_has_not_received() -> None:
    schedule = pipeline_schedule(BASE)
    keep = crossing_messages(schedule, 4)
    # Stage k has N - k - 1 forwards in flight; the newest one's activations are in transit.
    assert keep == {0: {("F", 6)}, 1: {("F", 5)}, 2: {("F", 4)}, 3: set()}
    assert [cut_index(schedule, r, 4) for r in range(4)] == [
        schedule.actions[r].index(next(a for a in schedule.actions[r] if str(a) == f"{r}UPDATE3"))
        for r in range(4)
    ]
    sync = pipeline_schedule(
        replace_fields(BASE, schedule="gpipe", micro_batches=2, weights="stale")
    )
    assert crossing_messages(sync, 4) == {r: set() for r in range(4)}  # nothing in flight


@pytest.mark.parametrize("schedule,weights,optimizer,micro", MODES)
def test_emulator_resumes_bit_identically(
    tmp_path: Path, schedule: str, weights: str, optimizer: str, micro: int
) -> None:
    config = replace_fields(
        BASE,
        schedule=schedule,
        weights=weights,
        optimizer=optimizer,
        micro_batches=micro,
        lr=0.05 if optimizer == "sgd" else 3e-3,
    )
    alone = Emulator(config).run()
    checkpointed = Emulator(config, checkpoint=_plan(tmp_path, 4)).run()
    assert (checkpointed.losses, checkpointed.params_sha256) == (alone.losses, alone.params_sha256)
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == 9  # steps 4, 8 and the last, 9
    resumed = Emulator(config, resume=(str(tmp_path), 4)).run()
    assert resumed.losses == alone.losses and resumed.params_sha256 == alone.params_sha256
    assert resumed.eval == alone.eval and resumed.prediction_error == alone.prediction_error


def test_a_half_written_set_is_passed_over_and_another_runs_set_refused(tmp_path: Path) -> None:
    Emulator(BASE, checkpoint=_plan(tmp_path, 4)).run()
    shutil.rmtree(step_dir(tmp_path, 9))
    (step_dir(tmp_path, 8) / "rank-2.pt").unlink()  # as if rank 2 died while writing
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == 4
    with pytest.raises(PipeswapError, match="written with test = 'snapshot'.*'other'"):
        check_identity(found[1], {"test": "other"}, "the checkpoint")
    shutil.rmtree(step_dir(tmp_path, 4))
    (step_dir(tmp_path, 8) / "manifest.json").unlink()
    assert latest_complete(tmp_path) is None
    with pytest.raises(PipeswapError, match="no such directory"):
        latest_complete(tmp_path / "missing")


@pytest.mark.dist
@pytest.mark.slow  # the SIGTERM test beside it stays in the fast suite
def test_runtime_killed_mid_run_resumes_bit_identically_in_runtime_and_emulator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = replace_fields(BASE, steps=12, timeout_s=10)
    alone = Emulator(config).run()
    monkeypatch.setenv(FAULT_ENV, "1:6")  # stage 1 is SIGKILLed after its step 6
    killed = spawn(train_checkpointed, 4, config, _plan(tmp_path, 4, every=3), None, timeout_s=10)
    assert not killed.ok and killed.exit_codes[1] == -9
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == 6  # steps 3 and 6 were written before the kill
    monkeypatch.delenv(FAULT_ENV)
    resumed = spawn(train_checkpointed, 4, config, None, (str(tmp_path), 6), timeout_s=10)
    assert resumed.ok, resumed.exit_codes
    assert resumed.results[0] == (alone.losses, alone.params_sha256)
    emulated = Emulator(config, resume=(str(tmp_path), 3)).run()  # the runtime's files
    assert (emulated.losses, emulated.params_sha256) == (alone.losses, alone.params_sha256)


@pytest.mark.parametrize("name,status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_to_the_emulator_checkpoints_at_a_cut_all_stages_agree_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, status: int
) -> None:
    """SIGTERM (a job scheduler) and Ctrl-C alike: a checkpoint every stage agrees on."""
    # As in the foreground: a background job's shell ignores Ctrl-C, and so does a run
    # started there (pipeswap.checkpoint keeps an ignored signal ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _stopped_by_a_signal_and_resumed(tmp_path, monkeypatch, name, status)
    finally:
        signal.signal(signal.SIGINT, previous)


def _stopped_by_a_signal_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, status: int
) -> None:
    config = replace_fields(BASE, steps=14)
    alone = Emulator(config).run()
    monkeypatch.setenv(FAULT_ENV, f"0:3:{name}")  # stage 0 gets it after its 4th step
    # Stage 0 sees it at its next update (5 steps done) and picks the cut after 5 + N + 2.
    with pytest.raises(RunStopped, match=f"stopped by {name} after step 11") as info:
        Emulator(config, checkpoint=_plan(tmp_path, 4, every=0)).run()
    assert info.value.exit_status == status
    monkeypatch.delenv(FAULT_ENV)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["step-00000011"]
    resumed = Emulator(config, resume=(str(tmp_path), 11)).run()
    assert (resumed.losses, resumed.params_sha256) == (alone.losses, alone.params_sha256)


@pytest.mark.slow  # make test-slow; make test keeps a smaller case of it
@pytest.mark.dist
def test_sigterm_to_a_runtime_rank_checkpoints_every_stage_then_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = replace_fields(BASE, steps=14, timeout_s=10)
    alone = Emulator(config).run()
    monkeypatch.setenv(FAULT_ENV, "0:3:SIGTERM")
    stopped = spawn(train_checkpointed, 4, config, _plan(tmp_path, 4, every=0), None, timeout_s=10)
    assert not stopped.ok and all(m and "after step 11" in m for m in stopped.messages)
    monkeypatch.delenv(FAULT_ENV)
    resumed = spawn(train_checkpointed, 4, config, None, (str(tmp_path), 11), timeout_s=10)
    assert resumed.ok, resumed.exit_codes
    assert resumed.results[0] == (alone.losses, alone.params_sha256)
