"""Versioned JSON files written atomically, so a crash never leaves half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeswap.errors import PipeswapError


def write_atomic(path: str | os.PathLike[str], text: str | bytes) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode() if isinstance(text, str) else text
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def dump_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def load_json(path: str | os.PathLike[str], expected_format: str | None = None) -> dict[str, Any]:
    """Read a JSON object; when ``expected_format`` is given, check its ``format`` field."""
    try:
        with open(path) as handle:
            obj = json.load(handle)
    except FileNotFoundError:
        raise PipeswapError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
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
