"""Naming a module's saved tensors for the swap runtime, and checking a plan against them.

Any ``nn.Module`` works: its layers are named submodules in forward order (a zoo model's
blocks by default). The naming is the profiler's (pipeswap.profiling.saved), so a plan
made from a profile names the same tensors the executor sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import nn

from pipeswap.config import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.models.state import untouched
from pipeswap.profile import Profile
from pipeswap.profiling.saved import SavedRecord, SavedTensorCapture, storage_key
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan, close_names
from pipeswap.swap.plan.workload import Swap, Workload

SavedKey = tuple[str, int]  # (owner layer, saved index), the profiler's name of a tensor


class _LayerView:
    """What SavedTensorCapture needs of a model, for any nn.Module and listed submodules."""

    def __init__(self, model: nn.Module, layers: dict[str, nn.Module]) -> None:
        self._model = model
        self._layers = layers
        self.layer_names = list(layers)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(self._layers.items())

    def parameters(self) -> Iterator[nn.Parameter]:
        return self._model.parameters()

    def buffers(self) -> Iterator[torch.Tensor]:
        return self._model.buffers()


def resolve_layers(model: nn.Module, layers: Sequence[str] | None) -> dict[str, nn.Module]:
    """The named submodules that are the plan's layers; a zoo model's blocks by default."""
    if layers is None:
        names = getattr(model, "layer_names", None)
        if names is None:
            raise PipeswapError(
                f"{type(model).__name__} names no layers of its own: pass its layers as a list of "
                "submodule names in forward order, e.g. layers=['encoder.0', 'encoder.1', 'head']"
            )
        layers = list(names)
    if not layers:
        raise PipeswapError("the list of layers is empty; name the submodules in forward order")
    modules = dict(model.named_modules())
    resolved: dict[str, nn.Module] = {}
    for name in layers:
        if name not in modules or not name:
            known = [n for n in modules if n]
            raise PipeswapError(f"the model has no submodule {name!r}; {close_names(name, known)}")
        if name in resolved:
            raise PipeswapError(f"layer {name!r} is listed twice; list each layer once")
        resolved[name] = modules[name]
    return resolved


def capture_records(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    layers: Sequence[str] | None = None,
) -> tuple[dict[str, list[SavedRecord]], dict[str, list[SavedKey | None]]]:
    """Run ``forward_loss`` once (no backward) and name the tensors it saves per layer.

    Returns the profiler's records and, per layer, the name each pack call saved (None for
    a parameter or buffer). Buffers (BatchNorm statistics) and the random state are put
    back afterwards, so the pass leaves no trace on training.
    """
    capture = _capture(model, forward_loss, layers, None)
    return capture.records(), capture.pack_calls()


class InnerSaves:
    """What a recomputed layer's own forward saves, noted during a plain (tagged) pass.

    The executor sets :attr:`layer` while a recomputed layer's forward runs and notes its
    tensor inputs in :attr:`inputs`; the capture notes every storage saved meanwhile.
    """

    def __init__(self) -> None:
        self.layer: str | None = None
        self.inputs: dict[str, set[int]] = {}  # per layer: storage keys of its inputs
        self.saved: dict[str, dict[int, int]] = {}  # per layer: storage key -> bytes
        self.owner: dict[int, str] = {}  # storage key -> the last layer that saved it

    def rerun_bytes(self, layer: str, *, own: bool = False) -> int:
        """Bytes a re-run of ``layer`` saves anew: everything its forward saves except its
        inputs, which the checkpoint keeps and the re-run saves again without a copy.

        With ``own``, only the storages the layer owns (as the profiler names them): not
        its output kept by its last op, which a later layer owns.
        """
        inputs = self.inputs.get(layer, set())
        return sum(
            n
            for key, n in self.saved.get(layer, {}).items()
            if key not in inputs and (not own or self.owner.get(key) == layer)
        )


class _TaggingCapture(SavedTensorCapture):
    """SavedTensorCapture that also fills an :class:`InnerSaves`."""

    def __init__(self, view: _LayerView, inner: InnerSaves, resident: set[int]) -> None:
        super().__init__(view)  # type: ignore[arg-type]
        self._inner = inner
        self._resident_keys = resident

    def _pack(self, tensor: torch.Tensor) -> object:
        layer = self._inner.layer
        key = storage_key(tensor)
        if key not in self._resident_keys:
            if self.layer is not None:
                self._inner.owner[key] = self.layer  # forward order: the last one wins
            if layer is not None:
                self._inner.saved.setdefault(layer, {})[key] = tensor.untyped_storage().nbytes()
        return super()._pack(tensor)


def capture_inner(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    layers: Sequence[str] | None,
    inner: InnerSaves,
) -> tuple[dict[str, list[SavedRecord]], dict[str, list[SavedKey | None]]]:
    """:func:`capture_records`, also noting in ``inner`` what recomputed layers save."""
    capture = _capture(model, forward_loss, layers, inner)
    return capture.records(), capture.pack_calls()


def _capture(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    layers: Sequence[str] | None,
    inner: InnerSaves | None,
) -> SavedTensorCapture:
    resolved = resolve_layers(model, layers)
    view = _LayerView(model, resolved)
    if inner is None:
        capture = SavedTensorCapture(view)  # type: ignore[arg-type]
    else:
        resident = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        capture = _TaggingCapture(view, inner, resident)
    # The pass leaves no trace: buffers (BatchNorm statistics), modes and random state
    # are put back, as the profiler does.
    with untouched(model, check=False), capture:
        loss = forward_loss()
        del loss
    return capture


def kept_key(layer: str, index: int) -> SavedKey:
    """The executor's name for a tensor only a recomputed layer saves (its kept input)."""
    return (f"{layer} (kept)", index)


class StepNames(NamedTuple):
    """How the executor names what a step with recomputed layers saves."""

    pack_calls: dict[str, list[SavedKey | None]]  # per layer, the name each pack call saves
    sizes: dict[SavedKey, int]  # bytes of every name
    kept_bytes: dict[str, int]  # per recomputed layer: what it holds from forward to backward


def step_names(
    plain: tuple[dict[str, list[SavedRecord]], dict[str, list[SavedKey | None]]],
    checkpointed: tuple[dict[str, list[SavedRecord]], dict[str, list[SavedKey | None]]],
    recompute: Sequence[str],
) -> StepNames:
    """Name a checkpointed step's pack calls as the plan (the profiler) names tensors.

    ``plain`` is a capture of the forward as the profiler ran it, ``checkpointed`` one
    with the recomputed layers under checkpoint: their own saves vanish, their inputs are
    saved once more by the checkpoint, and a storage may then change owner (a block's
    input saved by the previous block's last op and kept by the checkpoint). Every other
    layer packs the same tensors in the same order in both passes, so zipping their pack
    calls maps each checkpointed name to the plan's name; what only recomputed layers
    save gets a :func:`kept_key` name.
    """
    records, calls = plain
    c_records, c_calls = checkpointed
    skip = set(recompute)
    plan_name: dict[SavedKey, SavedKey] = {}
    for layer, mine in calls.items():
        if layer in skip:
            continue
        theirs = c_calls[layer]
        if len(theirs) != len(mine):
            raise PipeswapError(
                f"layer {layer!r} saved {len(mine)} tensors in a plain forward but "
                f"{len(theirs)} with {', '.join(recompute)} recomputed; the forward must run "
                "the same operations every time (no data-dependent branches)"
            )
        for a, c in zip(mine, theirs):
            if a is None and c is None:
                continue
            if a is None or c is None or plan_name.setdefault(c, a) != a:
                raise PipeswapError(
                    f"layer {layer!r} saved other tensors with {', '.join(recompute)} "
                    "recomputed than in a plain forward; the forward must run the same "
                    "operations every time"
                )
    sizes = {(layer, r.index): r.bytes for layer, recs in records.items() for r in recs}
    owner: dict[SavedKey, str] = {key: key[0] for key in sizes}
    for layer, recs in c_records.items():
        for r in recs:
            if (layer, r.index) not in plan_name:
                sizes[kept_key(layer, r.index)] = r.bytes
                owner[kept_key(layer, r.index)] = layer
    pack_calls = {
        layer: [None if c is None else plan_name.get(c, kept_key(*c)) for c in keys]
        for layer, keys in c_calls.items()
    }
    # What a recomputed layer holds through the step: the storages its steps still save
    # (its input, kept by the checkpoint; tensors of ops between it and the next layer).
    kept_bytes = dict.fromkeys(recompute, 0)
    for key in {key for keys in pack_calls.values() for key in keys if key is not None}:
        if owner[key] in kept_bytes:
            kept_bytes[owner[key]] += sizes[key]
    return StepNames(pack_calls, sizes, kept_bytes)


def check_budget(
    gpu_plan: GpuPlan,
    decisions: dict[SavedKey, SwapDecision],
    records: dict[str, list[SavedRecord]],
    names: list[str],
    *,
    resident_bytes: int,
    transient: Sequence[int],
    device: torch.device,
    kept_bytes: dict[str, int] | None = None,
    rerun_bytes: dict[str, int] | None = None,
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
    )
    position = {name: i for i, name in enumerate(names)}
    swaps = [
        Swap(
            position[d.layer],
            d.index,
            d.bytes,
            position[d.out_after],
            n if d.prefetch_after is None else position[d.prefetch_after],
        )
        for d in decisions.values()
    ]
    forward, backward = workload.memory_points(swaps)
    needed = max(max(forward), max(backward))
    budget = gpu_plan.budget_bytes
    if needed > budget:
        raise ConfigError(
            f"rank {gpu_plan.rank}: the plan cannot keep its budget of {budget} bytes on this "
            f"device: with its swaps{' and recomputation' if gpu_plan.recompute else ''} a "
            f"step needs {needed} bytes, {needed - budget} bytes "
            f"({(needed - budget) / 2**20:.2f} MiB) more; give a larger {{gpu_memory_bytes}} (or "
            "a smaller {footprint_ratio}) or a policy that swaps or recomputes"
        )
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        if budget > total:
            raise ConfigError(
                f"the plan's budget of {budget} bytes is {budget - total} bytes more than "
                f"this GPU's {total}; plan with {{gpu_memory_bytes}} {total} or less"
            )
    return needed


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
    decisions: dict[SavedKey, SwapDecision], records: dict[str, list[SavedRecord]]
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
            raise PipeswapError(
                f"the plan was made for another profile: tensor ({layer!r}, {index}) has "
                f"{decision.bytes} bytes in the plan but {saved[index].bytes} in this run "
                "(a different batch, sequence length, image size or dtype?); profile and "
                "plan again with this run's settings"
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
