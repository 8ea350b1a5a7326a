"""Checkpoints: one file per rank and a manifest, written atomically; the newest complete set wins.

Layout of ``--checkpoint-dir DIR``::

    DIR/step-00000010/manifest.json   # written first: identity and the files that make the set
    DIR/step-00000010/rank-0.pt       # each rank's state after optimizer step 10 (torch.save)
    DIR/step-00000010/rank-1.pt

A step directory is complete when its manifest and every rank file it names exist; each
file is written to a temporary name and renamed, so a rank killed while writing leaves
the set incomplete and :func:`latest_complete` passes it over. The manifest's
``identity`` (model, mode, world size, schedule, ... and the pipeswap version) must
equal the resuming run's, or :func:`check_identity` names the difference.
"""

from __future__ import annotations

import io
import os
import random
import re
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json, load_json, write_atomic

CHECKPOINT_FORMAT = "pipeswap.checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run checkpoints, and who it is (for the manifest)."""

    directory: str
    every: int  # optimizer steps between checkpoints (0: only when stopped by SIGTERM)
    identity: dict[str, Any]
    world_size: int

    def due(self, done: int, steps: int) -> bool:
        """Checkpoint after ``done`` optimizer steps? (Never after the last one.)"""
        return self.every > 0 and done % self.every == 0 and done < steps


class RunStopped(PipeswapError):
    """SIGTERM stopped the run after a checkpoint; the message says how to resume."""

    exit_status = 128 + signal.SIGTERM

    def __init__(self, directory: str, done: int) -> None:
        super().__init__(
            f"stopped by SIGTERM after step {done}; its checkpoint is in {directory}: "
            f"continue with --resume {directory}"
        )


class StopOnSigterm:
    """Turns SIGTERM into a request to stop at the next step boundary (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._request)

    def _request(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def step_dir(directory: str | os.PathLike[str], done: int) -> Path:
    return Path(directory) / f"step-{done:08d}"


def write_manifest(plan: CheckpointPlan, done: int) -> None:
    """Name the set of step ``done`` (rank files follow; the set is complete once all exist)."""
    dump_json(
        step_dir(plan.directory, done) / "manifest.json",
        {
            "format": CHECKPOINT_FORMAT,
            "step": done,
            "identity": plan.identity,
            "files": [f"rank-{r}.pt" for r in range(plan.world_size)],
        },
    )


def save_rank(plan: CheckpointPlan, done: int, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` after ``done`` steps, atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_atomic(step_dir(plan.directory, done) / f"rank-{rank}.pt", buffer.getvalue())


def latest_complete(directory: str | os.PathLike[str]) -> tuple[int, dict[str, Any]] | None:
    """The newest step whose manifest and rank files all exist, with its manifest."""
    root = Path(directory)
    if not root.is_dir():
        raise PipeswapError(f"--resume {directory}: no such directory; give a --checkpoint-dir")
    steps = sorted(
        (int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))),
        reverse=True,
    )
    for done in steps:
        folder = step_dir(root, done)
        if not (folder / "manifest.json").is_file():
            continue
        manifest = load_json(folder / "manifest.json", CHECKPOINT_FORMAT)
        if all((folder / name).is_file() for name in manifest.get("files", [])):
            return done, manifest
    return None


def check_identity(manifest: dict[str, Any], identity: dict[str, Any], where: str) -> None:
    """Refuse a checkpoint written by another run, naming the first field that differs."""
    theirs = manifest.get("identity", {})
    for key in sorted(set(theirs) | set(identity)):
        if theirs.get(key) != identity.get(key):
            raise PipeswapError(
                f"{where} was written with {key} = {theirs.get(key)!r}, but this run has "
                f"{identity.get(key)!r}; resume with the same settings or start afresh"
            )


def load_rank(directory: str | os.PathLike[str], done: int, rank: int) -> dict[str, Any]:
    """This rank's state from the set of step ``done``."""
    path = step_dir(directory, done) / f"rank-{rank}.pt"
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as exc:
        raise PipeswapError(f"cannot read checkpoint {path}: {exc}") from None
    return state


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
