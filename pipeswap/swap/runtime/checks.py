"""Checking a SwapPlan against the model and the run it is applied to, and where copies go."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan, close_names
from pipeswap.swap.plan.measured import measured_memory
from pipeswap.swap.plan.tensors import SavedKey, SwapDecisionAt
from pipeswap.swap.plan.workload import Workload, workload_from_profile

__all__ = [
    "PLAN_SLACK",
    "IssuePoints",
    "check_budget",
    "check_plan_identity",
    "check_records",
    "checked_decisions",
    "checked_recompute",
    "forward_need",
    "issue_points",
    "rank_plan",
    "step_budget",
    "step_refusal",
]

# How far this run's own sizes may put a plan over its budget before it is refused.
PLAN_SLACK = 0.01


def check_budget(
    gpu_plan: GpuPlan,
    decisions: dict[SavedKey, SwapDecision],
    records: dict[str, list[CapturedSavedTensor]],
    names: list[str],
    *,
    resident_bytes: int,
    transient: Sequence[int],
    device: torch.device,
    kept_bytes: dict[str, int] | None = None,
    rerun_bytes: dict[str, int] | None = None,
    backward_transient: Sequence[int] = (),
    floor_bytes: int = 0,
    turn_bytes: int = 0,
) -> int:
    """Refuse a plan whose budget cannot hold this run's saved tensors and state; returns
    the bytes a step needs at most.

    Uses the planner's own memory model (Workload.memory_points) with the sizes this run
    actually saves, and says by how many bytes the budget falls short. A recomputed layer
    holds ``kept_bytes`` from its forward to its backward, and its re-run's
    ``rerun_bytes`` from right before its backward to its end.
    """
    n = len(names)
    kept_bytes = kept_bytes or {}
    rerun_bytes = rerun_bytes or {}
    saved = tuple(tuple((r.index, r.bytes) for r in records[name]) for name in names)
    all_saved = [sum(b for _, b in layer) for layer in saved]
    workload = Workload(
        model="",
        names=tuple(names),
        forward_s=(0.0,) * n,
        backward_s=(0.0,) * n,
        saved=saved,
        transient=tuple(transient),
        param_bytes=(0,) * n,
        resident_bytes=resident_bytes,
        optimizer_step_s=0.0,
        # The workload's re-run holds its saved bytes less input_saved: measured here.
        input_bytes=tuple(kept_bytes.get(name, 0) for name in names),
        input_saved=tuple(all_saved[i] - rerun_bytes.get(name, 0) for i, name in enumerate(names)),
        recompute=frozenset(i for i, name in enumerate(names) if name in gpu_plan.recompute),
        backward_transient=tuple(backward_transient),
        floor_bytes=floor_bytes,
        turn_bytes=turn_bytes,
    )
    position = {name: i for i, name in enumerate(names)}
    swaps = [SwapDecisionAt.of_decision(d, position) for d in decisions.values()]
    forward, backward = workload.memory_points(swaps)
    needed = max(max(forward), max(backward), floor_bytes)
    budget = gpu_plan.budget_bytes
    # The plan was made from a profile's sizes; this run's own may differ by a storage or
    # two (how a shared tensor is named when other layers are recomputed): within this
    # slack the plan runs, and the device's meter, not this check, has the last word.
    if needed > budget * (1 + PLAN_SLACK):
        # A plan that recomputes every layer (and swaps nothing), or swaps every saved
        # tensor, holds the least its kind of plan can: its need is the smallest budget.
        every = [(name, r.index) for name in names for r in records[name]]
        if not swaps and set(names) <= set(gpu_plan.recompute):
            least = "with every layer recomputed"
        elif every and all(key in decisions for key in every):
            least = "with every saved tensor swapped"
        else:
            least = ""
        raise ConfigError(
            f"rank {gpu_plan.rank}: the plan cannot keep its budget of {budget} bytes on this "
            f"device: with its swaps{' and recomputation' if gpu_plan.recompute else ''} a "
            f"step needs {needed} bytes, {needed - budget} bytes "
            f"({(needed - budget) / 2**20:.2f} MiB) more; "
            + (
                f"{least}, the smallest budget that works is {needed} bytes: give "
                "{gpu_memory_bytes} at least that, or a policy that both swaps and recomputes"
                if least
                else "give a larger {gpu_memory_bytes} (or a smaller {footprint_ratio}) or a "
                "policy that swaps or recomputes"
            )
        )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if budget > total:
            raise ConfigError(
                f"the plan's budget of {budget} bytes is {budget - total} bytes more than "
                f"this GPU's {total}; plan with {{gpu_memory_bytes}} {total} or less"
            )
    return needed


def step_budget(
    gpu_plan: GpuPlan,
    decisions: dict[SavedKey, SwapDecision],
    records: dict[str, list[CapturedSavedTensor]],
    names: list[str],
    *,
    profile: Profile | None,
    device: torch.device,
    kept_bytes: dict[str, int],
    rerun_bytes: dict[str, int],
    own_rerun_bytes: dict[str, int],
) -> int:
    """:func:`check_budget` for an executor: the resident bytes and working sets are the
    profile's (none without one); with them, a re-run's copy of its output (saved by its
    last op, owned by the next layer) takes the room its working set has for it, as in the
    planner's model, so only what the layer owns counts (``own_rerun_bytes``). A tensor the
    forward returns (or was called with) that the profile does not list as saved counts
    where the profile does."""
    transient: Sequence[int] = [0] * len(names)
    backward: Sequence[int] = ()
    resident = 0 if profile is None else profile.resident_bytes
    floor = turn = 0
    rerun = rerun_bytes
    if profile is not None and profile.layer_names == names:
        # A saved storage the profile leaves out (the loop or the model's code holds it:
        # pipeswap.training.loop_profile) is in its working sets; so, where the meter read
        # them, is any other it leaves out of a layer it names as this run does.
        listed = {la.name: {(t.index, t.bytes) for t in la.saved} for la in profile.layers}
        read = profile.memory is not None
        records = {
            name: _profiled(recs, listed.get(name, set()), read) for name, recs in records.items()
        }
        transient = [la.workspace_bytes + la.output_bytes for la in profile.layers]
        rerun = own_rerun_bytes
        if profile.memory is not None:
            # What the meter read: the working sets hold whatever the layers' saved tensors
            # do not, so a re-run counts all it saves.
            resident, transient, backward, turn, floor = measured_memory(profile)
            rerun = rerun_bytes
    return check_budget(
        gpu_plan,
        decisions,
        records,
        names,
        resident_bytes=resident,
        transient=transient,
        device=device,
        kept_bytes=kept_bytes,
        rerun_bytes=rerun,
        backward_transient=backward,
        floor_bytes=floor,
        turn_bytes=turn,
    )


def _profiled(
    records: list[CapturedSavedTensor], listed: set[tuple[int, int]], read: bool
) -> list[CapturedSavedTensor]:
    """A layer's records less those its profile leaves out (``listed``): see step_budget."""
    alike = read and listed <= {(r.index, r.bytes) for r in records}
    return [r for r in records if (r.index, r.bytes) in listed or not (r.held_anyway() or alike)]


def check_plan_identity(
    plan: SwapPlan, model: nn.Module, layer_names: list[str], profile: Profile | None
) -> None:
    """Refuse a plan made for another model, other layers, another dtype, or (with a
    profile) another batch, sequence length or image size.

    The plan records the profile it was made for (model, batch, dtype, seq_len,
    image_size); plans written before it did are checked on what they have.
    """
    name = getattr(model, "name", None)
    if isinstance(name, str) and plan.model != name:
        raise PipeswapError(
            f"the plan was made for model {plan.model!r}, not {name!r}; make a plan from a "
            f"profile of {name}"
        )
    for layer in plan.layers:
        if layer not in layer_names:
            raise PipeswapError(
                f"the plan names layer {layer!r}, which the model does not have; "
                f"{close_names(layer, layer_names)}"
            )
    if list(plan.layers) != layer_names:
        raise PipeswapError(
            f"the plan's layers {list(plan.layers)} are not the model's layers "
            f"{layer_names} in forward order; make the plan from this model's profile"
        )
    dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    if plan.dtype is not None and dtypes and plan.dtype not in dtypes:
        raise PipeswapError(
            f"the plan was made for a {plan.dtype} profile but the model's parameters "
            f"are {', '.join(sorted(dtypes))}; profile and plan again in this dtype"
        )
    if profile is None:
        return
    if profile.model != plan.model:
        raise PipeswapError(
            f"the plan was made for {plan.model!r} but the profile is of {profile.model!r}"
        )
    mismatch = plan.profile_mismatch(profile)
    if mismatch is not None:
        raise PipeswapError(
            f"the plan was made for another profile ({mismatch}); plan again from this profile"
        )
    if dtypes and profile.dtype not in dtypes:
        raise PipeswapError(
            f"the plan was made for a {profile.dtype} profile but the model's parameters "
            f"are {', '.join(sorted(dtypes))}; profile and plan again in this dtype"
        )


def checked_decisions(gpu_plan: GpuPlan, names: list[str]) -> dict[SavedKey, SwapDecision]:
    """The rank's decisions by tensor name; refuses unknown layers and early swap-outs.

    A prefetch point at or before the owner is accepted: the tensor is then needed before
    its prefetch and is fetched late (and counted), which is how late fetches are tested.
    """
    position = {name: i for i, name in enumerate(names)}
    decisions: dict[SavedKey, SwapDecision] = {}
    for d in gpu_plan.swaps:
        for point in (d.layer, d.out_after, d.prefetch_after):
            if point is not None and point not in position:
                raise PipeswapError(
                    f"{gpu_plan.gpu}: the plan names layer {point!r}, which the model does not "
                    f"have; {close_names(point, names)}"
                )
        if position[d.out_after] < position[d.layer]:
            raise PipeswapError(
                f"{gpu_plan.gpu}: tensor ({d.layer!r}, {d.index}) is swapped out after "
                f"{d.out_after!r}, before its layer has run; name {d.layer!r} or a later layer"
            )
        if (d.layer, d.index) in decisions:
            raise PipeswapError(
                f"{gpu_plan.gpu}: tensor ({d.layer!r}, {d.index}) is swapped twice; list it once"
            )
        decisions[(d.layer, d.index)] = d
    return decisions


def checked_recompute(gpu_plan: GpuPlan, layers: dict[str, nn.Module]) -> list[str]:
    """The rank's recomputed layers, in forward order; refuses unknown and nested ones.

    A recomputed layer's forward is re-run as a whole, so no other listed layer may be
    inside it (its hooks would fire again in the backward).
    """
    names = list(layers)
    gpu_plan.check_recompute(names, "the model")
    recompute = set(gpu_plan.recompute)
    for name in recompute:
        inside = {id(m) for m in layers[name].modules() if m is not layers[name]}
        nested = [other for other in names if id(layers[other]) in inside]
        if nested:
            raise PipeswapError(
                f"{gpu_plan.gpu}: recomputed layer {name!r} contains layer {nested[0]!r}; "
                "list layers that do not nest, or recompute the inner ones"
            )
    for d in gpu_plan.swaps:
        if d.layer in recompute:
            raise PipeswapError(
                f"{gpu_plan.gpu}: tensor ({d.layer!r}, {d.index}) is swapped, but its layer is "
                "recomputed; a recomputed layer keeps no saved tensor, so drop one of the two"
            )
    return [name for name in names if name in recompute]


def check_records(
    decisions: dict[SavedKey, SwapDecision], records: dict[str, list[CapturedSavedTensor]]
) -> None:
    """Refuse a plan whose tensors this run does not save, or saves at another size."""
    for (layer, index), decision in decisions.items():
        saved = records[layer]
        if index >= len(saved):
            raise PipeswapError(
                f"the plan swaps tensor ({layer!r}, {index}) but layer {layer!r} saves "
                f"{len(saved)} tensors (indices 0..{len(saved) - 1}) in this run; the plan "
                "was made for another profile (model, batch or dtype): plan again"
            )
        if saved[index].bytes != decision.bytes:
            # A saved tensor moves with its whole storage: a view of a larger tensor (a
            # slice of a bigger batch) weighs its storage, more than the profile measured.
            view = (
                " or an input that is a view of a larger tensor (swapping moves whole "
                "storages: pass a tensor of its own, e.g. x.clone())"
                if saved[index].bytes > decision.bytes
                else ""
            )
            raise PipeswapError(
                f"the plan was made for another profile: tensor ({layer!r}, {index}) has "
                f"{decision.bytes} bytes in the plan but {saved[index].bytes} in this run "
                f"(a different batch, sequence length, image size or dtype{view}?); profile "
                "and plan again with this run's settings"
            )


class IssuePoints(NamedTuple):
    """Where the executor issues each copy, each list in backward order (needed first)."""

    outs_after: dict[str, list[SavedKey]]  # swap-outs issued as the next layer starts
    outs_at_turn: list[SavedKey]  # swap-outs after the last layer's forward
    prefetch_after: dict[str, list[SavedKey]]  # prefetches once a layer's backward is done
    prefetch_at_turn: list[SavedKey]  # prefetches at the forward/backward turn


def issue_points(decisions: dict[SavedKey, SwapDecision], names: list[str]) -> IssuePoints:
    """Group the decisions by the point that issues their swap-out and their prefetch."""
    points = IssuePoints({}, [], {}, [])
    position = {name: i for i, name in enumerate(names)}
    # Needed first, issued first: the copy engine is FIFO.
    for key in sorted(decisions, key=lambda k: (-position[k[0]], k[1])):
        decision = decisions[key]
        if decision.out_after == names[-1]:
            points.outs_at_turn.append(key)
        else:
            points.outs_after.setdefault(decision.out_after, []).append(key)
        if decision.prefetch_after is None:
            points.prefetch_at_turn.append(key)
        else:
            points.prefetch_after.setdefault(decision.prefetch_after, []).append(key)
    return points


def rank_plan(plan: SwapPlan, rank: int) -> GpuPlan:
    for gpu_plan in plan.gpus:
        if gpu_plan.rank == rank:
            return gpu_plan
    ranks = sorted(g.rank for g in plan.gpus)
    raise PipeswapError(
        f"the plan has no part for rank {rank}: it plans ranks {ranks} "
        f"({len(plan.gpus)} GPUs); make the plan for as many GPUs as there are ranks"
    )


def forward_need(
    profile: Profile | None,
    names: list[str],
    gpu_plan: GpuPlan,
    recompute: Sequence[str],
    name: str,
) -> int:
    """What ``name``'s forward takes on the device by the plan's memory model: its saved
    tensors (a recomputed layer's kept input) and its working set; the last layer's holds
    the turn after it (the head, the loss and their backward). 0 without a profile of
    these layers."""
    if profile is None or profile.layer_names != names:
        if profile is None or name not in profile.layer_names:
            return 0
        layer = profile.layer(name)
        return layer.workspace_bytes + layer.output_bytes
    position = names.index(name)
    chosen = [names.index(layer) for layer in gpu_plan.selective]
    recomputed = [names.index(layer) for layer in recompute]
    workload = workload_from_profile(profile).selecting(chosen).recomputing(recomputed)
    return workload.saved_bytes[position] + workload.forward_working[position]


def step_refusal(*, prepared: bool, closed: bool, active: bool) -> str | None:
    """Why SwapExecutor.forward() may not start a step now (None: it may)."""
    if not prepared:
        return "call SwapExecutor.prepare(forward_loss) before the first step"
    if closed:
        return "this SwapExecutor was closed (its with block ended): make another for more steps"
    if not torch.is_grad_enabled():
        return (
            "a step under torch.no_grad() saves nothing to swap: run evaluation outside "
            "SwapExecutor.forward()"
        )
    if active:
        return "SwapExecutor.forward() does not nest; finish the step first"
    return None
