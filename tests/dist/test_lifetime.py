"""No rank outlives its launcher: SIGINT, SIGTERM and SIGKILL to the launcher of a real run.

Covers: pipeswap/dist/launch.py (the launcher's signal handling and parent-death signal).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeswap.checkpoint import latest_complete

pytestmark = [pytest.mark.dist, pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")]

TRAIN = [
    sys.executable,
    "-m",
    "pipeswap",
    "train",
    "--model",
    "gpt2-micro",
    "--seq-len",
    "16",
    "--batch",
    "4",
    "--steps",
    # Longer than the test waits, and within the most a pipeline schedules up front
    # (1,000,000 steps were refused by the ranks, so whether they were still alive when
    # the signal came depended on the machine's speed).
    "20000",
    "--device",
    "cpu",
    "--timeout",
    "10",
]
MODES = {
    "data-parallel": ["--nproc", "2", "--swap-policy", "none"],
    "pipeline": ["--pipeline", "2", "--nproc", "2"],
}


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            alive.append(int(entry.name))
    return alive


def _wait_for(predicate, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.parametrize(
    "mode,signum",
    [
        ("data-parallel", signal.SIGINT),
        ("data-parallel", signal.SIGTERM),
        ("data-parallel", signal.SIGKILL),
        ("pipeline", signal.SIGTERM),
        ("pipeline", signal.SIGKILL),
    ],
)
def test_no_process_of_the_run_survives_its_launcher(
    mode: str, signum: int, tmp_path: Path
) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    launcher = subprocess.Popen(
        [*TRAIN, *MODES[mode]],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # The launcher and both ranks are up (a rank is a child of the launcher).
        assert _wait_for(lambda: len(_group(launcher.pid)) >= 3, 90), "ranks never started"
        time.sleep(3.0)  # into the training loop
        os.kill(launcher.pid, signum)
        code = launcher.wait(timeout=30)
        assert _wait_for(lambda: not _group(launcher.pid), 30), _group(launcher.pid)
    finally:
        for pid in _group(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = launcher.stderr.read().decode() if launcher.stderr else ""
    assert code == (-signum if signum == signal.SIGKILL else 128 + signum), err[-2000:]
    assert "Traceback" not in err
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("pipeswap-")]
    assert leftovers == []


@pytest.mark.parametrize("mode", ["data-parallel", "pipeline"])
def test_sigterm_to_the_launcher_leaves_a_complete_checkpoint(mode: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    folder, report = tmp_path / "ckpt", tmp_path / "r.json"
    launcher = subprocess.Popen(
        # A pipeline's schedule is data: a few thousand steps build quickly and last long enough.
        [
            *TRAIN,
            *MODES[mode],
            "--checkpoint-dir",
            str(folder),
            "--checkpoint-every",
            "5",
            *(["--steps", "3000"] if mode == "pipeline" else ["--report", str(report)]),
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # A first periodic checkpoint: the ranks are training (and handle SIGTERM).
        assert _wait_for(lambda: folder.is_dir() and latest_complete(folder), 120)
        os.kill(launcher.pid, signal.SIGTERM)
        code = launcher.wait(timeout=60)
        assert _wait_for(lambda: not _group(launcher.pid), 30), _group(launcher.pid)
    finally:
        for pid in _group(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = launcher.stderr.read().decode() if launcher.stderr else ""
    assert code == 143 and "stopped by SIGTERM after step" in err, err[-2000:]
    found = latest_complete(folder)
    assert found is not None and f"after step {found[0]}" in err
    assert err.count("stopped by SIGTERM") == 1  # said once, by the launcher
    if mode == "data-parallel":  # the ranks' report of the steps they did
        done = json.loads(report.read_text())
        assert done["stopped_by"] == "SIGTERM" and len(done["losses"]) == found[0]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_takes_the_whole_run_down(signum: int, tmp_path: Path) -> None:
    """A rank that dies: its peer fails within --timeout, the launcher exits 1, no survivor.
    A rank that gets SIGTERM as it trains (a scheduler's notice): every rank stops after
    the same step, the run says so and exits 143."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["TMPDIR"] = str(tmp_path)
    log = tmp_path / "err.log"
    with open(log, "wb") as err_file:
        launcher = subprocess.Popen(
            [*TRAIN, *MODES["data-parallel"]],
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
        )
    try:
        assert _wait_for(lambda: len(_children(launcher.pid)) >= 2, 90), "ranks never started"
        assert _wait_for(lambda: "step 10/" in log.read_text(), 90), "training never started"
        os.kill(max(_children(launcher.pid)), signum)  # the later-started rank
        code = launcher.wait(timeout=60)
        assert _wait_for(lambda: not _group(launcher.pid), 30), _group(launcher.pid)
    finally:
        for pid in _group(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    err = log.read_text()
    if signum == signal.SIGKILL:
        assert code == 1 and "was killed by SIGKILL" in err, err[-2000:]
    else:
        assert code == 143 and "stopped by SIGTERM after step" in err, err[-2000:]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("pipeswap-")] == []
