"""A HiGHS solver whose console output goes to our logger, never to our stdout."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
from typing import Any

__all__ = ["LOG", "quiet_highs"]

LOG = logging.getLogger("pipeswap.mip")


def quiet_highs(*, time_limit_s: float, threads: int = 1) -> Any:
    """A ``highspy.Highs`` with its output off, its banner logged at debug level.

    HiGHS prints its banner from C++ while the object is built, before any option can
    turn output off, so file descriptor 1 itself points at a temporary file meanwhile
    (``plan --json`` must print nothing but JSON).
    """
    import highspy  # here, not at the top: HiGHS loads only when a MIP is solved

    with tempfile.TemporaryFile() as banner:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(banner.fileno(), 1)
        try:
            highs = highspy.Highs()
            _flush_c_stdio()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        banner.seek(0)
        text = banner.read().decode(errors="replace").strip()
    if text:
        LOG.debug("%s", text)
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("threads", threads)
    return highs


def _flush_c_stdio() -> None:
    """Flush the C library's stdout buffer, where the banner may still wait when stdout
    is a pipe, so it reaches the temporary file and not the restored descriptor."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to call (not Linux or macOS)
        pass
