"""How a shape is learnt before any plan exists: a step within the memory of a plan, timed.

A plan needs a profile of the call it serves, and the profile needs a step of that call;
run as it is, that step would hold the no-swap peak that the budget exists to avoid. So
under every policy but ``none`` the step that is learnt runs with every saved tensor on
the host (pipeswap.profiling.on_host), keeping only what a plan that swaps every layer's
saved tensors would keep, while a meter reads what the step as it is holds. Policy
``none`` keeps everything, so its step runs as it is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.on_host import every_saved_tensor_on_host

__all__ = ["LEARNT_BY", "SAID", "learning_step", "learnt_by"]

# How a step that is learnt runs: as it is, or with the saved tensors on the host.
LEARNT_BY = ("as-is", "on-host")
SAID = {  # what a learnt step does, said in a step's stats
    how: f"runs {doing}, timed and metered, to plan it and every later shape "
    "(offload.plan_for(...) before the loop plans it)"
    for how, doing in (
        ("as-is", "as it is"),
        ("on-host", "with every saved tensor on the host"),
    )
}


def learnt_by(policy: str) -> str:
    """How a shape is learnt under swap policy ``policy`` (one of :data:`LEARNT_BY`)."""
    return "as-is" if policy == "none" else "on-host"


def learning_step(
    how: str,
    model: nn.Module,
    layers: dict[str, nn.Module],
    timing: BlockTiming | None = None,
) -> AbstractContextManager[Any]:
    """The context a learnt step's forward runs in (``how``: one of :data:`LEARNT_BY`);
    its copies back are noted in ``timing``."""
    if how == "on-host":
        return every_saved_tensor_on_host(model, layers, timing)
    return nullcontext()
