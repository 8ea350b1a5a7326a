"""A documented test hook that signals one rank at a step boundary: PIPESWAP_FAULT="rank:step".

Tests of rank-failure handling set it before launching; the drivers call the hook once
per optimizer step, after the step, never inside a forward or backward pass. The rank
kills itself with SIGKILL, as the kernel's out-of-memory killer would, or sends itself
the signal named third (``"0:40:SIGTERM"``, what a job scheduler sends).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from pipeswap.errors import PipeswapError

__all__ = ["FAULT_ENV", "fault_hook"]

FAULT_ENV = "PIPESWAP_FAULT"


def fault_hook(rank: int) -> Callable[[int], None] | None:
    """What to call after each optimizer step of ``rank`` (None when no fault is asked for)."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return None
    fault_rank, _, rest = spec.partition(":")
    step, _, name = rest.partition(":")
    try:
        at_rank, at_step = int(fault_rank), int(step or 0)
        signum = signal.Signals[name or "SIGKILL"]
    except (ValueError, KeyError):
        raise PipeswapError(
            f"{FAULT_ENV}={spec!r} is not RANK:STEP[:SIGNAL] (e.g. 2:3 or 0:40:SIGTERM); "
            "unset it to train normally"
        ) from None
    if at_rank != rank:
        return None

    def after_step(done: int) -> None:
        if done == at_step:
            os.kill(os.getpid(), signum)

    return after_step
