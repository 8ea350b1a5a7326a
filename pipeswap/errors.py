"""The one exception type users see: a message that says what was wrong and what to do."""

import os

__all__ = ["PipeswapError", "crash_line", "debugging", "first_line"]


class PipeswapError(Exception):
    """Bad input or an impossible request; the message names the fix.

    The CLI prints the message and exits with status 2 instead of a traceback.
    """


def first_line(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def crash_line(exc: BaseException) -> str:
    """A crash (not bad input) in one line, and how to see its traceback."""
    return f"{first_line(exc)} (set PIPESWAP_DEBUG=1 for the traceback)"


def debugging() -> bool:
    """Whether PIPESWAP_DEBUG asks for tracebacks instead of one-line crash reports."""
    return os.environ.get("PIPESWAP_DEBUG", "") not in ("", "0")
