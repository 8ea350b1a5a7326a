"""Which plan serves a call: a plan made for a shape serves every call it covers.

A loop that pads each batch to its own longest sequence calls the model with a new shape
at almost every step. A plan made for one call serves any call of the same structure
(the same arguments, dtypes, devices and other values) whose every tensor is no larger in
any dimension: its layers save the same tensors in the same order, each no larger than
its host slot, and what it holds at every moment is no more than the larger call held
(pipeswap.swap.runtime.step_tensors swaps a smaller tensor into its slot). So only a call
that no plan covers needs a plan of its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from pipeswap.config import ConfigError
from pipeswap.profile import StepMemory
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.training.loop_calls import Signature
from pipeswap.training.loop_plans import LoopPlanner, ShapePlan, on_device
from pipeswap.units import format_bytes


def covers(large: Signature, small: Signature) -> bool:
    """Whether a plan made for ``large`` serves a call of ``small``."""
    (spec, leaves, cast), (other_spec, other_leaves, other_cast) = large, small
    if spec != other_spec or cast != other_cast or len(leaves) != len(other_leaves):
        return False
    for big, little in zip(leaves, other_leaves, strict=True):
        if isinstance(big, str) or isinstance(little, str):
            if big != little:
                return False
            continue
        shape, *rest = big
        other_shape, *other_rest = little
        if rest != other_rest or len(shape) != len(other_shape):
            return False
        if any(b < s for b, s in zip(shape, other_shape, strict=True)):
            return False
    return True


def smallest_covering(signature: Signature, planned: Iterable[Signature]) -> Signature | None:
    """The smallest of ``planned`` that covers ``signature`` (None: none does)."""
    best: Signature | None = None
    for candidate in planned:
        if covers(candidate, signature) and (best is None or _size(candidate) < _size(best)):
            best = candidate
    return best


def describe(signature: Signature) -> str:
    """The call's tensor shapes, as a user would write them: ``4x128, 4x128``."""
    shapes = [leaf[0] for leaf in signature[1] if not isinstance(leaf, str)]
    return (
        ", ".join("x".join(str(d) for d in shape) or "scalar" for shape in shapes) or "no tensors"
    )


def _size(signature: Signature) -> int:
    total = 0
    for leaf in signature[1]:
        if not isinstance(leaf, str):
            count = 1
            for d in leaf[0]:
                count *= d
            total += count
    return total


def largest_covered(signature: Signature, planned: Iterable[Signature]) -> Signature | None:
    """The largest of ``planned`` that ``signature`` covers (None: none)."""
    smaller = [c for c in planned if covers(signature, c)]
    return max(smaller, key=_size, default=None)


class ShapePlans:
    """A loop's plans by the call each was made for, and the plan that serves a call."""

    def __init__(self, planner: LoopPlanner) -> None:
        self.planner = planner
        self.plans: dict[Signature, ShapePlan] = {}
        self.declared: Signature | None = None  # the largest call, as plan_for gave it

    def serving(
        self, signature: Signature, args: Any, kwargs: Any, device: torch.device
    ) -> tuple[Signature | None, ShapePlan | None]:
        """The call whose plan serves this one, and the plan (None: none does yet, learn
        it). A plan whose measured step held too much is made again first; a call larger
        than plan_for's is refused, or recomputes every layer (see :meth:`beyond`)."""
        covering = smallest_covering(signature, self.plans)
        if covering is not None:
            planned = self.plans[covering]
            if planned.replan_due:
                assert planned.call is not None
                call = on_device(planned.call, device)
                planned = self.plans[covering] = self.planner.replan(planned, *call)
            return covering, planned
        if self.declared is None:
            return None, None
        planned = self.plans[signature] = self.beyond(signature, args, kwargs)
        return signature, planned

    def plan(
        self,
        signature: Signature,
        call: tuple[Any, Any],
        timing: BlockTiming,
        memory: StepMemory | None,
        **settings: Any,
    ) -> None:
        """Plan a timed call (``settings``: LoopPlanner.plan_shape's); a step cut short
        leaves its timing incomplete, and the call is learnt again."""
        if not timing.complete(self.planner.layer_names):
            return
        fits = None
        if self.plans:
            largest = largest_covered(signature, self.plans)
            fits = "none of this structure" if largest is None else describe(largest)
        self.plans[signature] = self.planner.plan_shape(
            timing, call, memory, shape=describe(signature), fits=fits, **settings
        )

    def beyond(self, signature: Signature, args: Any, kwargs: Any) -> ShapePlan:
        """A call larger than plan_for's: refused before its forward, or (on_infeasible=
        "recompute-all") run recomputing every layer, beyond the budget."""
        assert self.declared is not None
        declared = self.plans[self.declared]
        over = (
            f"a batch of shape {describe(signature)} is larger than the largest that "
            f"offload.plan_for was given ({describe(self.declared)}), for which the budget "
            f"of {format_bytes(declared.budget_bytes)} was planned"
        )
        if self.planner.on_infeasible != "recompute-all":
            raise ConfigError(
                f"{over}: give plan_for the largest batch the loop makes, or pass "
                "offload(on_infeasible='recompute-all') to run larger ones recomputing every "
                "layer"
            )
        warnings.warn(
            f"pipeswap.offload: {over}; it runs recomputing every layer", RuntimeWarning, 5
        )
        return self.planner.recompute_all(declared, args, kwargs)

    def close(self) -> None:
        for planned in self.plans.values():
            if planned.executor is not None:
                planned.executor.close()
        self.plans.clear()
