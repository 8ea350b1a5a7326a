"""A budget no plan of a policy fits: the refusal, naming the smallest budget where one is known
(pipeswap.swap.plan.budget searches for it)."""

from __future__ import annotations

from typing import Any

from pipeswap.config_fields import ConfigError
from pipeswap.swap.plan.workload import Workload
from pipeswap.units import format_bytes, format_ratio_at_most

__all__ = ["BudgetRefused", "never_recomputed"]


def never_recomputed(workload: Workload) -> str:
    """Why the layers that keep state past their forward are never recomputed, naming
    each and its attributes ("" where none does): for a refusal or a warning."""
    held = [f"{workload.names[i]!r} ({workload.held(i)})" for i in range(workload.num_layers)]
    held = [h for i, h in enumerate(held) if workload.held(i)]
    if not held:
        return ""
    many = len(held) > 1
    return (
        f"layer{'s' if many else ''} {', '.join(held)} {'are' if many else 'is'} never "
        f"recomputed: {'each' if many else 'its'} forward leaves a tensor carrying the "
        "autograd graph in that attribute of its module (state kept past the forward), "
        "which would hold the re-run's saved tensors until the next forward; drop or "
        "detach that state after the forward to let it be recomputed"
    )


class BudgetRefused(ConfigError):
    """No plan of the policy fits the budget: ``reason`` says why, ``floor`` is a budget
    known to fail (the one refused, or the policy's floor less one byte), ``peak`` the
    no-swap peak the footprint ratio divides."""

    def __init__(self, reason: str, *, floor: int, peak: int, smallest: int | None) -> None:
        self.reason, self.floor, self.peak = reason, floor, peak
        super().__init__(reason if smallest is None else _naming(reason, smallest, peak))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Across processes (a plan refused on rank 0 reaches every rank) as it was made.
        return (_rebuilt, (self.message, self.reason, self.floor, self.peak))


def _rebuilt(message: str, reason: str, floor: int, peak: int) -> BudgetRefused:
    refused = BudgetRefused(reason, floor=floor, peak=peak, smallest=None)
    refused.message = message
    refused.args = (refused.render(lambda name: name),)
    return refused


def _naming(reason: str, smallest: int, peak: int) -> str:
    return (
        f"{reason}; the smallest budget that works is {smallest} bytes "
        f"({format_bytes(smallest)}), a footprint ratio of at most "
        f"{format_ratio_at_most(peak, smallest)}: pass {{gpu_memory_bytes}} {smallest} or more"
    )
