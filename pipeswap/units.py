"""Byte sizes as people write them ("16GiB", "1.5e9", "512MiB") and back."""

from __future__ import annotations

import math
import re

from pipeswap.errors import PipeswapError

__all__ = ["MAX_BYTES", "format_bytes", "format_ratio_at_most", "parse_bytes"]

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

_SIZE = re.compile(
    r"^\s*([+-]?(?:[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?|(?i:inf(?:inity)?|nan)))\s*([A-Za-z]*)\s*$"
)
# The largest byte count parse_bytes returns: what a signed 64-bit integer holds (8 EiB).
MAX_BYTES = 2**63 - 1


def parse_bytes(text: str | int | float) -> int:
    """A byte count from ``text``: "16GiB", "16GB", "1.5e9", "512MiB", "4096" or a number.

    Units are case-insensitive; GB/MB/KB/TB are decimal, GiB/MiB/KiB/TiB binary. The
    result must be a whole number of bytes from zero to ``MAX_BYTES`` (2**63 - 1).
    """
    if isinstance(text, bool):
        raise PipeswapError(f"not a byte size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise _not_finite_or_negative(text)
        return _in_range(text, text)
    number: int | float
    if isinstance(text, float):
        number, scale = text, 1
    else:
        match = _SIZE.match(text)
        if match is None:
            raise PipeswapError(
                f"not a byte size: {text!r}; write a number with an optional unit, "
                "e.g. 16GiB, 16GB, 512MiB or 1.5e9"
            )
        digits, unit = match.group(1), match.group(2)
        # Whole numbers stay exact (a float would round 2**63 - 1 up to 2**63).
        number = int(digits) if digits.lstrip("+-").isdigit() else float(digits)
        try:
            scale = _UNITS[unit.lower()]
        except KeyError:
            raise PipeswapError(
                f"unknown unit {unit!r} in {text!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            ) from None
    if not math.isfinite(number) or number < 0:
        raise _not_finite_or_negative(text)
    # Exact for whole numbers; a float product may overflow to inf, which is refused here too.
    value: int | float = number * scale
    _in_range(text, value)
    if isinstance(value, int):
        return value
    rounded = round(value)
    if abs(value - rounded) > 1e-6 * max(1.0, abs(value)):
        raise PipeswapError(f"byte size {text!r} is not a whole number of bytes ({value})")
    return _in_range(text, int(rounded))


def _not_finite_or_negative(text: str | int | float) -> PipeswapError:
    return PipeswapError(
        f"not a byte size: {text!r}; a byte size must be a finite number >= 0, "
        "e.g. 16GiB, 512MiB or 1.5e9"
    )


def _in_range(text: str | int | float, value: int | float) -> int:
    if value > MAX_BYTES:
        shown = f" ({value:.3g} bytes)" if math.isfinite(value) else ""
        raise PipeswapError(
            f"byte size {text!r} is larger than 2**63 - 1 bytes (8 EiB), the most a size may "
            f"be{shown}; check the number and its unit (e.g. 16GiB, 512MiB)"
        )
    return int(value)


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


def format_ratio_at_most(peak: int, smallest: int) -> str:
    """The largest footprint ratio ``peak / budget`` whose budget is at least ``smallest``,
    to three decimals, rounded down: the ratio a refusal names must itself be accepted."""
    return f"{math.floor(peak / smallest * 1000) / 1000:.3f}"
