"""A command's ``--json`` result alone on stdout: everything else printed meanwhile goes to stderr.

A user's model builder, a library loading weights, pipeswap's own notes: while a command
that was asked for ``--json`` runs, Python's ``sys.stdout`` is stderr, and only
:func:`print_json` writes to the real stdout, so ``pipeswap ... --json > out.json`` is
always JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

__all__ = ["json_stdout", "print_json"]

_REAL: list[TextIO] = []  # the real stdout while json_stdout is on


def print_json(value: Any) -> None:
    """Print the command's JSON result on the real stdout."""
    stream = _REAL[-1] if _REAL else sys.stdout
    print(json.dumps(value, indent=1), file=stream)
    stream.flush()


@contextmanager
def json_stdout(on: bool) -> Iterator[None]:
    """While on, anything printed to stdout goes to stderr; :func:`print_json` does not."""
    if not on:
        yield
        return
    _REAL.append(sys.stdout)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = _REAL.pop()
