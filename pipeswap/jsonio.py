"""Versioned JSON files written atomically, so a crash never leaves half a file.

Every failure a user can cause or fix (a bad path, no permission, a full disk, a file
that is not JSON) becomes a PipeswapError naming the file and the fix, never a traceback.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeswap.errors import PipeswapError

__all__ = [
    "MAX_JSON_BYTES",
    "PathArg",
    "check_format",
    "check_writable",
    "dump_json",
    "fix_of",
    "load_json",
    "reason_of",
    "write_atomic",
]

PathArg = str | os.PathLike[str]

# Larger than any profile, graph or plan pipeswap writes; a bigger "JSON" file is almost
# surely the wrong file, and reading it whole could exhaust memory.
MAX_JSON_BYTES = 256 * 2**20


def _blocking_file(folder: Path) -> Path | None:
    """The nearest existing ancestor of ``folder`` (itself included) if it is not a folder."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _not_regular(path: PathArg, target: Path) -> PipeswapError | None:
    """The refusal of an existing output that is no regular file (a device, a pipe, a
    socket): the rename would replace the node itself with a file."""
    try:
        mode = os.stat(target).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return PipeswapError(
        f"cannot write {path}: it is not a regular file (a device, pipe or socket); "
        "give a file name"
    )


def _write_error(path: PathArg, target: Path, exc: OSError) -> PipeswapError:
    """Turn an OSError from writing ``target`` (the resolved ``path``) into advice."""
    if isinstance(exc, IsADirectoryError) or target.is_dir():
        return PipeswapError(f"{path} is a directory; give a file name")
    if isinstance(exc, FileExistsError | NotADirectoryError):
        blocker = _blocking_file(target.parent)
        where = f"{blocker} is a file, not a folder" if blocker else "its folder cannot be created"
        return PipeswapError(f"cannot write {path}: {where}; choose another path")
    return PipeswapError(f"cannot write {path}: {reason_of(exc)}; {fix_of(exc)} another path")


def reason_of(exc: OSError) -> str:
    """Why a write failed, in the user's words: "permission denied", "the disk is full"..."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    reasons = {
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
        errno.EROFS: "read-only file system",
    }
    return reasons.get(exc.errno or 0, exc.strerror or str(exc))


def fix_of(exc: OSError) -> str:
    """The start of the fix for a failed write, to end with what to choose instead."""
    return "free space or choose" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "choose"


def _umask() -> int:
    # Python 3.11 has no os.getumask; setting the mask is the only way to read it.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: PathArg, text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename.

    A symlink is followed (its target is rewritten, the link stays), an existing file keeps
    its permission bits, and on any failure the old file is untouched and no temporary is left.
    """
    # Resolve so the rename replaces the link's target rather than the link itself.
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath gave up: a symlink loop
        raise PipeswapError(f"cannot write {path}: it is a symlink loop; choose another path")
    special = _not_regular(path, target)
    if special is not None:
        raise special
    data = text.encode() if isinstance(text, str) else text
    tmp: str | None = None
    try:
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()  # what open() would give a new file; mkstemp uses 0600
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise _write_error(path, target, exc) from exc
    finally:
        # Also on KeyboardInterrupt: never leave a stray .tmp beside the user's files.
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def dump_json(path: PathArg, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def _same_file(a: PathArg, b: PathArg) -> bool:
    try:
        return os.path.samefile(a, b)  # also catches hard links and symlinks
    except OSError:  # one of them does not exist yet
        return os.path.realpath(a) == os.path.realpath(b)


def check_writable(
    path: PathArg,
    *,
    inputs: Iterable[PathArg | None] = (),
    outputs: Iterable[PathArg | None] = (),
) -> None:
    """Refuse, before any work starts, an output ``path`` that write_atomic would fail on
    or that would overwrite one of the command's ``inputs`` (or land inside an input
    folder: a model directory, a folder of data) or its other ``outputs`` (``None``
    entries, i.e. options not given, are skipped). Creates nothing."""
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise PipeswapError(f"{path} is a directory; give a file name")
    special = _not_regular(path, target)
    if special is not None:
        raise special
    blocker = _blocking_file(target.parent)
    if blocker is not None:
        raise PipeswapError(
            f"cannot write {path}: {blocker} is a file, not a folder; choose another path"
        )
    folder = next(p for p in (target.parent, *target.parents) if p.exists())
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PipeswapError(
            f"cannot write {path}: permission denied in {folder}; choose another path"
        )
    for other in inputs:
        if other is not None and _same_file(path, other):
            raise PipeswapError(f"output {path} is also an input; write to another file")
        if (
            other is not None
            and os.path.isdir(other)
            and target.is_relative_to(os.path.realpath(other))
        ):
            raise PipeswapError(
                f"output {path} is inside {other}, a folder this run reads; write it to "
                "another folder"
            )
    for other in outputs:
        if other is not None and _same_file(path, other):
            raise PipeswapError(f"{path} is given as two outputs ({other}); give each its own file")


class _NonFinite(ValueError):
    """A JSON number that is not finite: Infinity, NaN, or a float too large (1e400)."""


def _parse_constant(token: str) -> float:
    raise _NonFinite(token)


def _parse_float(token: str) -> float:
    value = float(token)
    if not math.isfinite(value):
        raise _NonFinite(token)
    return value


def _read_text(path: PathArg) -> str:
    """The whole file as text, refusing anything too large or not UTF-8."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            # Read one byte past the limit: st_size is 0 for pipes and /proc files.
            raw = handle.read(MAX_JSON_BYTES + 1) if size <= MAX_JSON_BYTES else b""
    except (FileNotFoundError, NotADirectoryError):
        raise PipeswapError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise PipeswapError(f"{path} is a directory; give a JSON file") from None
    except PermissionError:
        raise PipeswapError(f"cannot read {path}: permission denied") from None
    except OSError as exc:
        raise PipeswapError(f"cannot read {path}: {exc.strerror or exc}") from None
    if size > MAX_JSON_BYTES or len(raw) > MAX_JSON_BYTES:
        shown = f"is {size} bytes" if size > MAX_JSON_BYTES else "is larger than that"
        raise PipeswapError(
            f"{path} {shown}; pipeswap reads JSON files of at most {MAX_JSON_BYTES} bytes "
            f"({MAX_JSON_BYTES / 2**20:g} MiB); is this the right file?"
        )
    try:
        return raw.decode("utf-8-sig")  # tolerate the BOM some Windows editors add
    except UnicodeDecodeError as exc:
        raise PipeswapError(
            f"{path} is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            f"give a JSON file written by pipeswap"
        ) from None


def load_json(path: PathArg, expected_format: str | None = None) -> dict[str, Any]:
    """Read a JSON object; when ``expected_format`` is given, check its ``format`` field."""
    text = _read_text(path)
    try:
        obj = json.loads(text, parse_constant=_parse_constant, parse_float=_parse_float)
    except _NonFinite as exc:
        raise PipeswapError(
            f"{path} contains a non-finite number ({exc}); pipeswap reads only finite numbers"
        ) from None
    except RecursionError:
        raise PipeswapError(
            f"{path} nests deeper than pipeswap reads; is this the right file?"
        ) from None
    except json.JSONDecodeError as exc:
        raise PipeswapError(f"{path}: not valid JSON ({exc})") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise PipeswapError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise PipeswapError(f"{path}: expected a JSON object, found {type(obj).__name__}")
    if expected_format is not None:
        check_format(obj, expected_format, where=str(path))
    return obj


def check_format(obj: dict[str, Any], expected_format: str, where: str = "input") -> None:
    """Refuse an object whose ``format`` is not ``expected_format`` (same name, same version)."""
    found = obj.get("format")
    if found != expected_format:
        raise PipeswapError(
            f"{where}: expected format {expected_format!r}, found {found!r}; "
            f"this file was not written by a compatible pipeswap"
        )
