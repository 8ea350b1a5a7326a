"""A new shape's profile made before its first step, from the shapes already measured.

Only the first shape of a run (and of each call structure) runs once unplanned, learnt
within a plan's memory (pipeswap.swap.runtime.learning), timed and metered: that is how
the budget is resolved. Every later shape no plan covers is planned
before its forward. What it saves is named exactly, by one forward that lets go of each
saved tensor as it runs (pipeswap.swap.runtime.capture: no backward follows, so the pass
holds no more than a planned step would). What cannot be named without running the step
(each layer's times, what recomputing it keeps and saves again, and the meter's working
sets at the layers' edges) is carried over from the measured shapes of the same
structure, per layer and per quantity: from one measured shape scaled by the ratio of
the layer's saved bytes (new / measured); from two or more by a fit of ``a*n + b*q``
(``n`` the call's tokens, ``q`` tokens times row length, where attention materialises
its scores; a, b >= 0). Its plan (pipeswap.training.loop_new_shapes) is made by the fast
heuristics within the run's one budget; the meter then checks the first step that runs
it, and the feedback (LoopPlanner.measured) plans the shape again for less if it held more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor, StepMemory
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.training.loop_calls import Signature, describe
from pipeswap.training.loop_plans import LoopPlanner
from pipeswap.training.loop_profile import saved_tensors

__all__ = [
    "Named",
    "Scaling",
    "derive_profile",
    "derived_profile",
    "features",
    "fit",
    "gradient_bytes",
    "input_bytes",
    "name_call",
    "same_structure",
]


def same_structure(a: Signature, b: Signature) -> bool:
    """Whether two calls differ only in their tensors' sizes and values (the same
    arguments, dtypes, devices, ranks and other values): one's profile can be scaled to
    the other (what each saves is named anyway)."""
    (spec, leaves, cast), (other_spec, other_leaves, other_cast) = a, b
    if spec != other_spec or cast != other_cast or len(leaves) != len(other_leaves):
        return False
    for x, y in zip(leaves, other_leaves, strict=True):
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                return False
        elif x[1:4] != y[1:4] or len(x[0]) != len(y[0]):
            return False
    return True


def features(signature: Signature) -> tuple[float, float]:
    """``(n, q)`` of a call: ``n`` the elements of its largest tensor (tokens, pixels), ``q``
    that times the length of one of its rows (batch x length^2: attention's scores)."""
    shapes: list[tuple[int, ...]] = [leaf[0] for leaf in signature[1] if not isinstance(leaf, str)]
    shape = max(shapes, key=math.prod, default=())
    n = float(math.prod(shape))
    row = n / shape[0] if len(shape) >= 2 and shape[0] else 1.0
    return n, n * row


def input_bytes(signature: Signature) -> int:
    """The bytes of the call's tensors (what the device holds of the batch)."""
    total = 0
    for leaf in signature[1]:
        if not isinstance(leaf, str):
            shape, dtype = leaf[0], leaf[1]
            total += math.prod(shape) * dtype.itemsize
    return total


def fit(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """The least-squares ``(a, b) >= 0`` of ``y = a*n + b*q`` through ``(n, q, y)`` points.

    Two unknowns: the unconstrained solution if it is non-negative, else the better of
    each feature alone (a negative coefficient would make a larger shape need less)."""
    snn = sum(n * n for n, _, _ in points)
    sqq = sum(q * q for _, q, _ in points)
    snq = sum(n * q for n, q, _ in points)
    sny = sum(n * y for n, _, y in points)
    sqy = sum(q * y for _, q, y in points)
    det = snn * sqq - snq * snq
    if det > 1e-9 * snn * sqq:
        a = (sny * sqq - sqy * snq) / det
        b = (sqy * snn - sny * snq) / det
        if a >= 0 and b >= 0:
            return a, b
    only_n = (max(0.0, sny / snn) if snn else 0.0, 0.0)
    only_q = (0.0, max(0.0, sqy / sqq) if sqq else 0.0)

    def residual(coef: tuple[float, float]) -> float:
        return sum((coef[0] * n + coef[1] * q - y) ** 2 for n, q, y in points)

    return min((only_n, only_q), key=residual)


class Scaling:
    """How each measured quantity of a layer carries over to the new shape.

    ``bases`` are the measured shapes' (signature, profile); ``saved`` the new shape's
    saved bytes per layer. One basis, or bases whose features do not tell a linear term
    from a quadratic one (a batch that changes alone): the nearest basis (by tokens),
    scaled by the layer's saved-bytes ratio. Otherwise a fit per layer and quantity."""

    def __init__(
        self,
        signature: Signature,
        bases: Sequence[tuple[Signature, Profile]],
        saved: dict[str, int],
    ) -> None:
        self.point = features(signature)
        self.bases = list(bases)
        self.saved = saved
        self.at = [features(sig) for sig, _ in self.bases]
        n = max(self.point[0], 1.0)
        self.nearest = min(
            range(len(self.bases)), key=lambda i: abs(math.log(max(self.at[i][0], 1.0) / n))
        )
        ratios = {q / max(m, 1.0) for m, q in self.at}
        self.fitting = len(self.bases) >= 2 and max(ratios) > min(ratios) * (1 + 1e-6)

    @property
    def nearest_profile(self) -> Profile:
        return self.bases[self.nearest][1]

    def ratio(self, layer: int | None) -> float:
        """The new shape's size over the nearest basis's: the layer's saved bytes (None,
        or a layer that saves nothing: the call's tokens)."""
        profile = self.nearest_profile
        if layer is not None:
            old = profile.layers[layer].saved_bytes
            if old > 0:
                return self.saved[profile.layers[layer].name] / old
        return self.point[0] / max(self.at[self.nearest][0], 1.0)

    def value(self, layer: int | None, measured: Sequence[float]) -> float:
        """A quantity at the new shape, from what it was at each basis (``measured``)."""
        if not self.fitting:
            return measured[self.nearest] * self.ratio(layer)
        a, b = fit([(n, q, y) for (n, q), y in zip(self.at, measured, strict=True)])
        return a * self.point[0] + b * self.point[1]


class Named(NamedTuple):
    """A call as its naming forward saw it: each layer's saved tensors and output bytes,
    and the parameters used after the last layer (the model's head: their gradients are
    made at the turn, so every layer's backward holds them whatever the shape)."""

    saved: dict[str, list[SavedTensor]]
    outputs: dict[str, int]
    head: list[nn.Parameter]


def name_call(
    model: nn.Module,
    layers: dict[str, nn.Module],
    args: Any,
    kwargs: Any,
    *,
    outputs_held: bool = False,
) -> Named:
    """:class:`Named` of one forward (as the steps run it, autocast's cache off) that lets
    go of what it saves as it runs; with ``outputs_held``, the saved storages among the
    outputs a loop holds are left out, as loop_profile leaves them out."""
    outputs: dict[str, int] = {}
    inside = {id(m) for layer in layers.values() for m in layer.modules()}
    last = list(layers)[-1]
    head: dict[int, nn.Parameter] = {}

    def note(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, given: Any, out: Any) -> None:
            leaves = tree_flatten(out)[0]
            outputs[name] = sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))

        return hook

    def after(module: nn.Module, given: Any) -> None:
        if last in outputs:  # the last layer's forward has ended
            head.update((id(p), p) for p in module.parameters(recurse=False))

    handles = [layer.register_forward_hook(note(name)) for name, layer in layers.items()]
    handles += [m.register_forward_pre_hook(after) for m in model.modules() if id(m) not in inside]
    try:
        records, _ = capture_records(model, lambda: model(*args, **kwargs), list(layers))
    finally:
        for handle in handles:
            handle.remove()
    saved = {
        name: list(saved_tensors(records.get(name, []), outputs_held=outputs_held))
        for name in layers
    }
    return Named(saved, outputs, list(head.values()))


def derive_profile(
    signature: Signature,
    bases: Sequence[tuple[Signature, Profile]],
    saved: dict[str, list[SavedTensor]],
    outputs: dict[str, int],
    *,
    later: Sequence[int],
    batch: int,
    source: str,
) -> Profile:
    """The new shape's profile: its saved tensors and outputs as named, every other
    quantity carried over from ``bases`` (see :class:`Scaling`; ``later``: see
    gradient_bytes)."""
    totals = {name: sum(t.bytes for t in tensors) for name, tensors in saved.items()}
    scaling = Scaling(signature, bases, totals)
    like = scaling.nearest_profile
    layers = []
    for i, layer in enumerate(like.layers):

        def scaled(get: Callable[[LayerProfile], float | None], i: int = i) -> float:
            return scaling.value(i, [get(p.layers[i]) or 0.0 for _, p in bases])

        def whole(get: Callable[[LayerProfile], int | None], i: int = i) -> int | None:
            # What the basis did not measure stays unmeasured.
            return None if get(like.layers[i]) is None else round(scaled(get, i))

        layers.append(
            replace(
                layer,
                forward_s=scaled(lambda x: x.forward_s),
                backward_s=scaled(lambda x: x.backward_s),
                output_bytes=outputs.get(layer.name, 0),
                saved=tuple(saved[layer.name]),
                workspace_bytes=round(scaled(lambda x: x.workspace_bytes)),
                forward_flops=round(scaled(lambda x: x.forward_flops)),
                backward_flops=round(scaled(lambda x: x.backward_flops)),
                kept_bytes=whole(lambda x: x.kept_bytes),
                rerun_bytes=whole(lambda x: x.rerun_bytes),
                rerun_output_bytes=whole(lambda x: x.rerun_output_bytes),
                selective_kept_bytes=whole(lambda x: x.selective_kept_bytes),
                selective_rerun_bytes=whole(lambda x: x.selective_rerun_bytes),
                selective_rerun_s=(
                    None
                    if layer.selective_rerun_s is None
                    else scaled(lambda x: x.selective_rerun_s)
                ),
            )
        )
    memory = None
    if all(p.memory is not None for _, p in bases):
        sizes = [totals[x.name] for x in like.layers]
        memory = _derived_memory(signature, bases, scaling, sizes, later)
    return replace(
        like,
        batch=batch,
        layers=tuple(layers),
        memory=memory,
        notes={**like.notes, "source": source},
    )


def _working(profile: Profile, later: Sequence[int]) -> tuple[list[int], list[int], int]:
    """What the meter read beyond what the device held at the start and the saved tensors
    counted so far: each layer's forward, each layer's backward beyond ``later[i]`` (the
    gradients of the layers after it, which no shape changes), the turn."""
    memory = profile.memory
    assert memory is not None
    start, held, cumulative = memory.start_bytes, 0, []
    for layer in profile.layers:
        held += layer.saved_bytes
        cumulative.append(held)
    forward = [max(0, p - start - c) for p, c in zip(memory.forward_peak_bytes, cumulative)]
    backward = [
        max(0, p - start - c - g)
        for p, c, g in zip(memory.backward_peak_bytes, cumulative, later, strict=True)
    ]
    turn = max(0, memory.turn_peak_bytes - start - cumulative[-1])
    return forward, backward, turn


def _derived_memory(
    signature: Signature,
    bases: Sequence[tuple[Signature, Profile]],
    scaling: Scaling,
    saved: list[int],
    later: Sequence[int],
) -> StepMemory:
    """The meter's readings the new shape's step would give: the start moved by the
    batch's bytes, the saved tensors as named, each working set carried over per layer
    (the turn, the model's head and loss, as the last layer's), the optimizer step as
    measured, moved with the start. ``later``: per layer, the gradient bytes its backward
    holds whatever the shape (gradient_bytes): only the rest of its working set is scaled
    (scaled whole, a small first shape's gradients would count several times over)."""
    sig, like = bases[scaling.nearest]
    assert like.memory is not None
    start = like.memory.start_bytes + input_bytes(signature) - input_bytes(sig)
    working = [_working(p, later) for _, p in bases]
    cumulative = [sum(saved[: i + 1]) for i in range(len(saved))]
    forward = tuple(
        start + c + round(scaling.value(i, [w[0][i] for w in working]))
        for i, c in enumerate(cumulative)
    )
    backward = tuple(
        start + c + later[i] + round(scaling.value(i, [w[1][i] for w in working]))
        for i, c in enumerate(cumulative)
    )
    # The turn (the head, its logits and the loss) as the last layer, not the call's largest
    # tensor: an encoder-decoder's logits grow with its labels, whatever its source does.
    last = len(saved) - 1
    turn = start + cumulative[-1] + round(scaling.value(last, [w[2] for w in working]))
    step = like.memory.step_peak_bytes
    return replace(
        like.memory,
        start_bytes=start,
        forward_peak_bytes=forward,
        turn_peak_bytes=turn,
        backward_peak_bytes=backward,
        step_peak_bytes=step + start - like.memory.start_bytes if step else 0,
    )


def gradient_bytes(layers: dict[str, nn.Module], head: Sequence[nn.Parameter]) -> list[int]:
    """Per layer, the gradient bytes its backward holds whatever the shape: those of the
    layers after it and of the model's head (``head``; trainable parameters only, each
    counted once)."""
    seen: set[int] = set()
    own = []
    for layer in layers.values():
        total = 0
        for param in layer.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
        own.append(total)
    outside = sum(
        p.numel() * p.element_size() for p in head if p.requires_grad and id(p) not in seen
    )
    return [sum(own[i + 1 :]) + outside for i in range(len(own))]


def derived_profile(
    planner: LoopPlanner,
    signature: Signature,
    call: tuple[Any, Any],
    bases: Sequence[tuple[Signature, Profile]],
) -> tuple[Profile, list[str]]:
    """A call's profile before its forward: named by one releasing forward, every other
    quantity carried over from ``bases`` (the measured shapes of its structure, Scaling);
    and the shapes it was carried over from."""
    args, kwargs = call
    with planner.quiet():
        held = planner.keep_outputs
        named = name_call(planner.model, planner.layers, args, kwargs, outputs_held=held)
    totals = {name: sum(t.bytes for t in tensors) for name, tensors in named.saved.items()}
    scaling = Scaling(signature, bases, totals)
    used = [bases[scaling.nearest]] if not scaling.fitting else list(bases)
    shapes = [describe(sig) for sig, _ in used]
    how = "fitted per layer to" if scaling.fitting else "scaled per layer from"
    profile = derive_profile(
        signature,
        used,
        named.saved,
        named.outputs,
        later=gradient_bytes(planner.layers, named.head),
        batch=_call_batch(call),
        source=f"pipeswap.offload: derived before its first step, {how} {'; '.join(shapes)}",
    )
    return profile, shapes


def _call_batch(call: tuple[Any, Any]) -> int:
    """The call's batch: its first tensor's first dimension (1 for a scalar or none)."""
    first = next((t for t in tree_flatten(call)[0] if isinstance(t, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1
