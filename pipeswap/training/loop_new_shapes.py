"""A new shape's plan before its forward, or its refusal naming the longest rows that fit.

A call no plan covers is planned from its derived profile (pipeswap.training.loop_derive)
by the fast heuristics within the run's one budget. Where no plan fits even with every
layer recomputed, the refusal says how long its rows may be: the call cut to shorter rows
(every tensor whose second dimension is the row length, the masks and labels too) is
named and derived again, a binary search over the length, each step one forward that lets
go of what it saves (no backward, no more memory than a planned step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from pipeswap.config_fields import ConfigError
from pipeswap.profiling.profile import Profile
from pipeswap.training.loop_calls import Signature, describe, modes_of
from pipeswap.training.loop_calls import signature as call_signature
from pipeswap.training.loop_derive import derived_profile
from pipeswap.training.loop_plans import LoopPlanner
from pipeswap.training.shape_plan import ShapePlan

__all__ = ["DERIVED_POLICIES", "SEARCHES", "derive_plan", "longest_rows", "with_rows"]

# The policies that search (the MIP and auto): a derived plan takes a heuristic instead,
# which plans in milliseconds (its profile is a model, not a measurement): the swaps of
# bidirectional (one simulation), or where they cannot fit, hybrid's swaps and
# recomputations (a ladder of simulations).
SEARCHES = ("mip", "auto")
DERIVED_POLICIES = ("bidirectional", "hybrid")


def derive_plan(
    planner: LoopPlanner,
    signature: Signature,
    call: tuple[Any, Any],
    bases: Sequence[tuple[Signature, Profile]],
    *,
    fits: str,
    check: bool,
    settings: Callable[[], dict[str, Any]] | None = None,
) -> ShapePlan:
    """The plan of a call no plan covers, made before its forward from ``bases`` (the
    measured shapes of its structure): named, derived, planned by the heuristics within
    the run's budget. Where its derived profile fits no plan, it is measured first (a step
    run aside, as offload.plan_for runs one, with ``settings``: LoopPlanner.plan_shape's):
    derived from much shorter calls, what a layer holds whatever the length scales with
    it, and a call that fits would be refused. No plan fits: refused naming ``fits``, the
    largest shape planned within it, and the longest rows that fit; or every layer
    recomputed (LoopPlanner's on_infeasible)."""
    started = time.perf_counter()
    profile, shapes = derived_profile(planner, signature, call, bases)
    config = planner.config
    configs = [config]
    if config.policy in SEARCHES:
        configs = [replace(config, policy=policy) for policy in DERIVED_POLICIES]
    try:
        if settings is not None and planner.least_budget(profile) > (planner.budget_bytes or 0):
            try:
                return _measured(planner, call, settings(), shape=describe(signature), fits=fits)
            except torch.OutOfMemoryError:  # too large to run aside: refused as derived
                pass
        return planner.settle(
            profile,
            call,
            started,
            shape=describe(signature),
            fits=fits,
            check=check,
            configs=configs,
            derived_from="; ".join(shapes),
            heuristic=DERIVED_POLICIES[-1] if config.policy in SEARCHES else None,
        )
    except ConfigError as refused:
        budget = planner.budget_bytes
        assert budget is not None
        try:
            found = longest_rows(call, lambda cut: _least(planner, cut, bases) <= budget)
        except Exception:  # noqa: BLE001 - a model that cannot run cut rows: no hint
            found = None
        if found is None:
            raise
        rows, length = found
        raise ConfigError(
            f"{refused.message.rstrip('.')}. By this batch's own profile, rows of at most "
            f"{length} fit the budget: a batch of {rows}x{length}."
        ) from None


def _measured(
    planner: LoopPlanner, call: tuple[Any, Any], settings: dict[str, Any], *, shape: str, fits: str
) -> ShapePlan:
    """``call``'s plan from a step of it run aside, timed and metered (a shape measured,
    as offload.plan_for measures one: later shapes are derived from it too)."""
    args, kwargs = call
    timing, memory = planner.aside(
        args, kwargs, settings["step_peak_bytes"], state_bytes=settings["state_bytes"]
    )
    return planner.plan_shape(timing, call, memory, shape=shape, fits=fits, **settings)


def _least(
    planner: LoopPlanner, call: tuple[Any, Any], bases: Sequence[tuple[Signature, Profile]]
) -> int:
    """The least budget of ``call`` under the run's policy, by its derived profile."""
    signature = call_signature(*call, planner.device, modes_of(planner.model))
    return planner.least_budget(derived_profile(planner, signature, call, bases)[0])


def longest_rows(
    call: tuple[Any, Any], fits: Callable[[tuple[Any, Any]], bool]
) -> tuple[int, int] | None:
    """(rows, length) of the longest rows of ``call``'s batch that ``fits`` (a binary
    search; None: the call has no rows to shorten, or one position does not fit). Rows
    are those of its first integer matrix (token ids): a batch of floats alone (images,
    whose second dimension is their channels) has none."""
    first = next((t for t in _tensors(call) if t.dim() >= 2 and not t.is_floating_point()), None)
    if first is None:
        return None
    rows, length = int(first.shape[0]), int(first.shape[1])
    low, high = 0, length  # low fits (0: nothing yet), high does not
    while high - low > 1:
        middle = (low + high) // 2
        if fits(with_rows(call, length, middle)):
            low = middle
        else:
            high = middle
    return None if low == 0 else (rows, low)


def with_rows(call: tuple[Any, Any], length: int, shorter: int) -> tuple[Any, Any]:
    """``call`` with every tensor whose second dimension is ``length`` cut to ``shorter``
    there (token ids, masks, labels, position ids alike)."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            return value[:, :shorter]
        return value

    result: tuple[Any, Any] = tree_map(cut, call)
    return result


def _tensors(call: tuple[Any, Any]) -> list[torch.Tensor]:
    return [v for v in tree_flatten(call)[0] if isinstance(v, torch.Tensor)]
