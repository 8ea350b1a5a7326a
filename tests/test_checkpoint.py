"""pipeswap/checkpoint.py: where a run writes, and checkpoints that are input, never code."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pipeswap.checkpoint import (
    CheckpointConfig,
    CheckpointPlan,
    hold_directory,
    latest_complete,
    load_rank,
    save_rank,
    step_dir,
    write_manifest,
)
from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError


def test_where_a_run_writes_its_checkpoints() -> None:
    assert CheckpointConfig().target is None
    assert CheckpointConfig(checkpoint_dir="a", resume="b").target == "a"
    assert CheckpointConfig(resume="b").target is None  # resumes, writes nothing more
    assert CheckpointConfig(resume="b", checkpoint_every=3).target == "b"


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"checkpoint_every": -1}, "checkpoint_every is -1"),
        ({"checkpoint_dir": ""}, "checkpoint_dir is empty"),
        ({"resume": ""}, "resume is empty"),
    ],
)
def test_bad_settings_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CheckpointConfig(**fields)  # type: ignore[arg-type]


def _set(tmp_path: Path, run_id: str, identity: dict[str, object]) -> CheckpointPlan:
    plan = CheckpointPlan(str(tmp_path), 2, identity, 2, run_id=run_id)
    write_manifest(plan, 2)
    for rank in range(2):
        save_rank(plan, 2, rank, {"weights": torch.full((2,), float(rank)), "done": 2})
    return plan


def test_a_set_loads_back_as_written(tmp_path: Path) -> None:
    _set(tmp_path, "a" * 32, {"seed": 0})
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == 2
    state = load_rank(tmp_path, 2, 1)
    assert torch.equal(state["weights"], torch.ones(2)) and state["done"] == 2


class _Payload:
    """Unpickling this runs code: it writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.write_text, (self.marker, "ran"))


def test_a_crafted_checkpoint_runs_no_code(tmp_path: Path) -> None:
    _set(tmp_path, "a" * 32, {"seed": 0})
    marker = tmp_path / "marker"
    crafted = {"run": "a" * 32, "rank": 0, "step": 2, "identity": {"seed": 0}}
    torch.save({**crafted, "state": {"x": _Payload(marker)}}, step_dir(tmp_path, 2) / "rank-0.pt")
    with pytest.raises(PipeswapError, match="cannot read checkpoint .*rank-0.pt"):
        load_rank(tmp_path, 2, 0)
    assert not marker.exists()


def test_a_set_mixed_from_two_runs_is_refused(tmp_path: Path) -> None:
    _set(tmp_path / "other", "b" * 32, {"seed": 1})
    _set(tmp_path / "mine", "a" * 32, {"seed": 0})
    mine, other = step_dir(tmp_path / "mine", 2), step_dir(tmp_path / "other", 2)
    shutil.copy(other / "rank-1.pt", mine / "rank-1.pt")
    load_rank(tmp_path / "mine", 2, 0)
    with pytest.raises(PipeswapError, match="does not belong to the set"):
        load_rank(tmp_path / "mine", 2, 1)
    # The same run's file under another step, or another rank's file, is refused too.
    _set(tmp_path / "mine", "a" * 32, {"seed": 0})
    shutil.copy(mine / "rank-0.pt", mine / "rank-1.pt")
    with pytest.raises(PipeswapError, match="does not belong to the set"):
        load_rank(tmp_path / "mine", 2, 1)


def test_one_live_run_holds_a_directory(tmp_path: Path) -> None:
    with hold_directory(tmp_path / "ck"):
        with pytest.raises(PipeswapError, match="in use by a live run \\(pid \\d+\\)"):
            with hold_directory(tmp_path / "ck"):
                pass
    with hold_directory(tmp_path / "ck"):  # released when the first run ended
        pass
    with hold_directory(None):
        pass


def _full_disk(monkeypatch: pytest.MonkeyPatch, *, at: str) -> None:
    """The disk fills up: writing the lock's owner (``at="lock"``), or a checkpoint's file
    (``at="file"``: every fsync, as write_atomic does before its rename), fails with ENOSPC."""
    if at == "lock":
        write = os.write

        def full(fd: int, data: bytes) -> int:
            if data.startswith(b"pid "):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(fd, data)

        monkeypatch.setattr(os, "write", full)
    else:

        def no_space(fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", no_space)


def test_a_full_disk_under_the_checkpoints_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _full_disk(monkeypatch, at="lock")
    with pytest.raises(PipeswapError, match="cannot write checkpoints to .*: the disk is full; "):
        with hold_directory(tmp_path / "ck"):
            pass


@pytest.mark.parametrize("at", ["lock", "file"])
def test_train_on_a_full_disk_exits_2_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], at: str
) -> None:
    from pipeswap.cli import main

    _full_disk(monkeypatch, at=at)
    argv = ["train", "--model", "gpt2-micro", "--seq-len", "8", "--batch", "2", "--steps", "1"]
    assert main([*argv, "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert "the disk is full; free space or choose another" in err and "Errno" not in err


def test_a_manifest_whose_settings_were_edited_is_refused_naming_what_differs(
    tmp_path: Path,
) -> None:
    _set(tmp_path, "a" * 32, {"seed": 0, "model": "gpt2-tiny"})
    manifest = step_dir(tmp_path, 2) / "manifest.json"
    edited = json.loads(manifest.read_text())
    edited["identity"]["model"] = "gpt2-micro"
    manifest.write_text(json.dumps(edited))
    with pytest.raises(
        PipeswapError,
        match=r"it says \{'model': 'gpt2-tiny'\}, the manifest \{'model': 'gpt2-micro'\}",
    ):
        load_rank(tmp_path, 2, 0)
