"""Fields of a JSON object, each checked: what was wrong, where, and what to write instead.

Each names the field and what to write; bool is refused where a number is meant because
Python counts True as 1, and JSON writers never mean a flag as a count.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable
from typing import Any

from pipeswap.errors import PipeswapError

__all__ = [
    "as_object",
    "count_field",
    "dumps_ok",
    "list_field",
    "only_known",
    "seconds_field",
    "shown",
    "text_field",
    "value_of",
]


def as_object(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise PipeswapError(f"{where}: expected a JSON object, found {shown(obj)}")
    return obj


def only_known(obj: dict[str, Any], known: Iterable[str], where: str) -> None:
    """Refuse a key ``obj`` should not have: a misspelt one would otherwise be ignored in
    silence and its field's default used (a task's "duraton_s" running for 0 s)."""
    names = list(known)
    for key in obj:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"its keys: {', '.join(names)}"
            raise PipeswapError(f"{where}: unknown key {key!r}; {hint}")


def list_field(
    obj: dict[str, Any], key: str, where: str, default: list[Any] | None = None
) -> list[Any]:
    value = value_of(obj, key, where, default)
    if not isinstance(value, list):
        raise PipeswapError(f"{where}: {key} is {shown(value)}; write a JSON list")
    return value


def text_field(obj: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = value_of(obj, key, where, default)
    if not isinstance(value, str):
        raise PipeswapError(f"{where}: {key} is {shown(value)}; write a string")
    return value


def seconds_field(obj: dict[str, Any], key: str, where: str) -> float:
    value = value_of(obj, key, where)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise PipeswapError(
            f"{where}: {key} is {shown(value)}; write a finite number of seconds >= 0"
        )
    return float(value)


def count_field(
    obj: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 0
) -> int:
    """A whole number >= ``minimum``; 1e9 written as a float is accepted, 1.5 is not."""
    value = value_of(obj, key, where, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        unit = " of bytes" if key.endswith("bytes") else ""
        raise PipeswapError(
            f"{where}: {key} is {shown(value)}; write a whole number{unit} >= {minimum}"
        )
    return value


_MISSING = object()


def value_of(obj: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> Any:
    if key in obj:
        return obj[key]
    if default is _MISSING or default is None:
        raise PipeswapError(f"{where}: {key} is missing; add it")
    return default


def shown(value: Any) -> str:
    text = json.dumps(value) if dumps_ok(value) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def dumps_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True
