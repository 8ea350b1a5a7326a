"""Byte sizes as people write them ("16GiB", "1.5e9", "512MiB") and back."""

from __future__ import annotations

import math
import re

from pipeswap.errors import PipeswapError

# Decimal units are powers of 1000 (as disk and link vendors use them), binary ones of 1024.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str | int | float) -> int:
    """A byte count from ``text``: "16GiB", "16GB", "1.5e9", "512MiB", "4096" or a number.

    Units are case-insensitive; GB/MB/KB/TB are decimal, GiB/MiB/KiB/TiB binary. The
    result must be a whole number of bytes no smaller than zero.
    """
    if isinstance(text, bool):
        raise PipeswapError(f"not a byte size: {text!r}")
    if isinstance(text, int | float):
        number, unit, scale = float(text), "", 1
    else:
        match = _SIZE.match(text)
        if match is None:
            raise PipeswapError(
                f"not a byte size: {text!r}; write a number with an optional unit, "
                "e.g. 16GiB, 16GB, 512MiB or 1.5e9"
            )
        number, unit = float(match.group(1)), match.group(2)
        try:
            scale = _UNITS[unit.lower()]
        except KeyError:
            raise PipeswapError(
                f"unknown unit {unit!r} in {text!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            ) from None
    if not math.isfinite(number) or number < 0:
        raise PipeswapError(f"byte size {text!r} must be a finite number >= 0")
    value = number * scale
    rounded = round(value)
    if abs(value - rounded) > 1e-6 * max(1.0, abs(value)):
        raise PipeswapError(f"byte size {text!r} is not a whole number of bytes ({value})")
    return int(rounded)


def format_bytes(count: int | float, *, binary: bool = True) -> str:
    """``count`` bytes in the largest unit that keeps the number at least 1: "16.00 GiB".

    Binary units (KiB, MiB, GiB, TiB) by default; ``binary=False`` gives KB, MB, GB, TB.
    """
    base = 1024 if binary else 1000
    names = ("KiB", "MiB", "GiB", "TiB") if binary else ("KB", "MB", "GB", "TB")
    value = float(count)
    if abs(value) < base:
        return f"{int(value)} B" if value == int(value) else f"{value:.1f} B"
    for position, unit in enumerate(names):
        value /= base
        if abs(value) < base or position == len(names) - 1:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
