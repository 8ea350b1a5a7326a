"""Checkpoints: one file per rank and a manifest, written atomically; the newest complete set wins.

Layout of a checkpoint directory ``DIR``::

    DIR/.lock                         # held by the live run writing here (flock)
    DIR/step-00000010/manifest.json   # written first: identity and the files that make the set
    DIR/step-00000010/rank-0.pt       # each rank's state after optimizer step 10 (torch.save)
    DIR/step-00000010/rank-1.pt

A step directory is complete when its manifest and every rank file it names exist; each
file is written to a temporary name and renamed, so a rank killed while writing leaves
the set incomplete and :func:`latest_complete` passes it over. The manifest's
``identity`` (model, mode, world size, schedule, ... and the pipeswap version) must
equal the resuming run's, or :func:`check_identity` names the difference.

A checkpoint is input, never code: rank files are read with ``torch.load(...,
weights_only=True)`` (tensors and plain data only). Every rank file carries the run's id,
its rank, its step and the run's identity, and is refused unless they match its
manifest's, so a set mixed from two runs, or one run's files moved under another's step,
is never resumed. Only one live run writes to a directory: :func:`hold_directory` takes
an exclusive lock that the kernel releases when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pickle
import random
import re
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeswap.config_fields import ConfigError, option, require
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json, fix_of, load_json, reason_of, write_atomic

__all__ = [
    "CHECKPOINT_FORMAT",
    "DEFAULT_EVERY",
    "CheckpointConfig",
    "CheckpointPlan",
    "RunStopped",
    "StopOnSigterm",
    "check_identity",
    "hold_directory",
    "latest_complete",
    "load_rank",
    "rng_state",
    "save_rank",
    "set_rng_state",
    "split_step_dir",
    "step_dir",
    "write_manifest",
]

CHECKPOINT_FORMAT = "pipeswap.checkpoint/2"
# Steps between checkpoints when a run has a checkpoint directory and no checkpoint_every
# (Hugging Face's Trainer and torchtitan save every 500 steps too).
DEFAULT_EVERY = 500
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where a run writes checkpoints, how often, and which one it continues from."""

    checkpoint_dir: str | None = option(
        None,
        metavar="DIR",
        help="write checkpoints here (every {checkpoint_every} steps, after the last step, "
        "and when stopped by SIGTERM or Ctrl-C)",
    )
    checkpoint_every: int | None = option(
        None,
        metavar="N",
        help=f"steps between checkpoints (default with {{checkpoint_dir}}: {DEFAULT_EVERY}; "
        "0: only after the last step and when stopped by SIGTERM or Ctrl-C)",
    )
    resume: str | None = option(
        None,
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR (or from the step folder "
        "DIR names: DIR/step-00000200)",
    )
    save: str | None = option(
        None,
        metavar="DIR",
        help="write the trained model to DIR after the last step, in the format it came in: "
        "a Hugging Face model as its save_pretrained() directory, any other module as "
        "model.safetensors of its own state_dict",
    )

    def __post_init__(self) -> None:
        require(
            self.checkpoint_every is None or self.checkpoint_every >= 0,
            f"{{checkpoint_every}} is {self.checkpoint_every}; use a number of steps (0: only "
            "after the last step and when stopped by SIGTERM or Ctrl-C)",
        )
        named = (
            ("checkpoint_dir", self.checkpoint_dir),
            ("resume", self.resume),
            ("save", self.save),
        )
        for name, value in named:
            require(value != "", f"{{{name}}} is empty; name a directory")

    @property
    def target(self) -> str | None:
        """Where the run writes checkpoints: ``checkpoint_dir``, else the ``resume`` folder
        when ``checkpoint_every`` asks for more."""
        if self.checkpoint_dir is not None:
            return self.checkpoint_dir
        return self._resume_root if self.checkpoint_every else None

    @property
    def every(self) -> int:
        """Steps between checkpoints: ``checkpoint_every``, else :data:`DEFAULT_EVERY`."""
        return DEFAULT_EVERY if self.checkpoint_every is None else self.checkpoint_every

    @property
    def directories(self) -> tuple[str, ...]:
        """The checkpoint directories of the run (the one it writes first): a save keeps
        them when they lie inside its directory, and falls back beside them."""
        return tuple(dict.fromkeys(d for d in (self.target, self._resume_root) if d is not None))

    @property
    def _resume_root(self) -> str | None:  # (``resume``, or its step folder's parent)
        return None if self.resume is None else split_step_dir(self.resume)[0]


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run checkpoints, and who it is (for the manifest)."""

    directory: str
    every: int  # optimizer steps between checkpoints (0: only the last and SIGTERM's)
    identity: dict[str, Any]
    world_size: int
    # One id per run, the same on every rank (pipeswap.training agrees on rank 0's).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def due(self, done: int, steps: int) -> bool:
        """Checkpoint after ``done`` optimizer steps? Every ``every`` steps, and after the
        last one (the trained state, which `pipeswap export` turns into the model)."""
        return done == steps or (self.every > 0 and done % self.every == 0 and done < steps)


class RunStopped(PipeswapError):
    """A signal (SIGTERM, or Ctrl-C's SIGINT) stopped the run after a checkpoint; the
    message says how to resume, the exit status is the shell's for that signal."""

    def __init__(self, directory: str, done: int, signal_name: str = "SIGTERM") -> None:
        super().__init__(
            f"stopped by {signal_name} after step {done}; its checkpoint is in {directory}: "
            f"continue with --resume {directory}"
        )
        self.exit_status = 128 + int(signal.Signals[signal_name])


class StopOnSigterm:
    """Turns SIGTERM (and the other ``signals`` given) into a request to stop at the next
    step boundary (main thread only); ``caught`` names the first signal that came.

    A signal this process ignores stays ignored (a spawned rank leaves Ctrl-C to its
    launcher). SIGTERM again changes nothing (a job scheduler may signal the launcher and
    its ranks alike), but SIGINT again stops at once (KeyboardInterrupt): Ctrl-C twice.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)) -> None:
        self.requested = False
        self.caught: str | None = None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._request)

    def _request(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.caught = self.caught or signal.Signals(signum).name

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def step_dir(directory: str | os.PathLike[str], done: int) -> Path:
    return Path(directory) / f"step-{done:08d}"


def write_manifest(plan: CheckpointPlan, done: int) -> None:
    """Name the set of step ``done`` (rank files follow; the set is complete once all exist)."""
    dump_json(
        step_dir(plan.directory, done) / "manifest.json",
        {
            "format": CHECKPOINT_FORMAT,
            "step": done,
            "run": plan.run_id,
            "identity": plan.identity,
            "files": [f"rank-{r}.pt" for r in range(plan.world_size)],
        },
    )


def save_rank(plan: CheckpointPlan, done: int, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's ``state`` after ``done`` steps, atomically, stamped with the run."""
    stamped = {"run": plan.run_id, "rank": rank, "step": done, "identity": plan.identity}
    buffer = io.BytesIO()
    torch.save({**stamped, "state": state}, buffer)
    write_atomic(step_dir(plan.directory, done) / f"rank-{rank}.pt", buffer.getvalue())


def latest_complete(
    directory: str | os.PathLike[str], step: int | None = None
) -> tuple[int, dict[str, Any]] | None:
    """The newest step whose manifest and rank files all exist, with its manifest (with
    ``step``: that step, if it is complete)."""
    root = Path(directory)
    require(
        root.is_dir(),
        f"{{resume}} {directory}: no such directory; give a {{checkpoint_dir}} a run wrote",
    )
    steps = sorted(
        (int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))),
        reverse=True,
    )
    if step is not None:
        steps = [done for done in steps if done == step]
    for done in steps:
        folder = step_dir(root, done)
        if not (folder / "manifest.json").is_file():
            continue
        manifest = _manifest(folder)
        if all((folder / name).is_file() for name in manifest.get("files", [])):
            return done, manifest
    return None


def split_step_dir(path: str | os.PathLike[str]) -> tuple[str, int | None]:
    """(directory, step) of a step's folder (``ckpt/step-00000200``); else (path, None)."""
    folder = Path(path)
    named = _STEP_DIR.match(folder.name)
    if named is None or not (folder / "manifest.json").is_file():
        return str(path), None
    return str(folder.parent), int(named.group(1))


def _manifest(folder: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = load_json(folder / "manifest.json", CHECKPOINT_FORMAT)
    return manifest


def check_identity(
    manifest: dict[str, Any],
    identity: dict[str, Any],
    where: str,
    fields: dict[str, str] | None = None,
) -> None:
    """Refuse a checkpoint written by another run, naming the first field that differs.

    ``fields`` names the config field that sets an identity key (``world_size``:
    ``nproc``): the refusal is then a ConfigError naming it as the caller does (a flag on
    the command line)."""
    theirs = manifest.get("identity", {})
    for key in sorted(set(theirs) | set(identity)):
        if theirs.get(key) == identity.get(key):
            continue
        was, now = theirs.get(key), identity.get(key)
        field_name = (fields or {}).get(key)
        if field_name is None:
            raise PipeswapError(
                f"{where} was written with {key} = {was!r}, but this run has {now!r}; "
                "resume with the same settings or start afresh"
            )
        hint = ""
        if field_name == "lr_decay_steps":
            hint = (
                " ({lr_decay_steps} defaults to the run's {steps}: give {lr_decay_steps} "
                f"{was} to go on decaying as it did)"
            )
        raise ConfigError(
            f"{where} was written with {{{field_name}}} {_shown(was)}, but this run has "
            f"{{{field_name}}} {_shown(now)}{hint}; resume with the same settings or start afresh"
        )


def _shown(value: Any) -> str:
    """A setting as its flag takes it: ``0.1``, ``adamw``, ``3,3,2`` (None: ``(none)``)."""
    if value is None:
        return "(none)"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(value)


def load_rank(directory: str | os.PathLike[str], done: int, rank: int) -> dict[str, Any]:
    """This rank's state from the set of step ``done``, refused unless it is that set's.

    Only tensors and plain data are read (``weights_only``): a file crafted to run code
    fails to load instead.
    """
    folder = step_dir(directory, done)
    path = folder / f"rank-{rank}.pt"
    try:
        stamped = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipeswapError(
            f"cannot read checkpoint {path} ({first}); it holds more than tensors and plain "
            "data, or is damaged: resume from another checkpoint or start afresh"
        ) from None
    manifest = _manifest(folder)
    expected = {"run": manifest.get("run"), "rank": rank, "step": done}
    found = {key: stamped.get(key) if isinstance(stamped, dict) else None for key in expected}
    identity, written = stamped.get("identity"), manifest.get("identity")
    if found != expected or identity != written:
        mine, theirs = (found, expected) if found != expected else (identity, written)
        if isinstance(mine, dict) and isinstance(theirs, dict):  # only what differs
            keys = sorted({*mine, *theirs}, key=str)
            differ = [k for k in keys if mine.get(k) != theirs.get(k)]
            mine, theirs = ({k: d.get(k) for k in differ} for d in (mine, theirs))
        raise PipeswapError(
            f"checkpoint {path} does not belong to the set of {folder} (it says {mine}, the "
            f"manifest {theirs}); a set mixed from two runs, or a manifest edited, cannot be "
            "read: use a set one run wrote as it wrote it, or start afresh"
        )
    state: dict[str, Any] = stamped["state"]
    return state


@contextlib.contextmanager
def hold_directory(directory: str | os.PathLike[str] | None) -> Iterator[None]:
    """Hold ``directory`` for this run: refuse it while another live run writes there.

    The lock is an ``flock`` on ``DIR/.lock``, released by the kernel when this process
    ends, so a crashed or killed run never leaves the directory locked. None: no lock.
    """
    if directory is None:
        yield
        return
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(root / ".lock", "a+")  # held until the run ends
    except OSError as exc:
        raise _cannot_write(directory, exc) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise PipeswapError(
                f"{directory} is in use by a live run ({holder}); wait for it to end, or "
                "write checkpoints to another directory"
            ) from None
        try:  # unbuffered: a full disk fails here, once, not again when the file closes
            os.ftruncate(handle.fileno(), 0)
            os.write(handle.fileno(), f"pid {os.getpid()}".encode())
        except OSError as exc:
            raise _cannot_write(directory, exc) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cannot_write(directory: str | os.PathLike[str], exc: OSError) -> PipeswapError:
    return PipeswapError(
        f"cannot write checkpoints to {directory}: {reason_of(exc)}; {fix_of(exc)} another "
        "directory"
    )


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
