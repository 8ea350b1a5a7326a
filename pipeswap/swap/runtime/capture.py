"""Naming a module's saved tensors for the swap runtime, and checking a plan against them.

Any ``nn.Module`` works: its layers are named submodules in forward order (a LayeredModel's
layers by default). The naming is the profiler's (pipeswap.profiling.saved), so a plan
made from a profile names the same tensors the executor sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import candidate_layers
from pipeswap.models.state import untouched
from pipeswap.profiling.metered_step import output_loss, output_tensors
from pipeswap.profiling.saved import CapturedSavedTensor, SavedTensorCapture, storage_key
from pipeswap.swap.plan import close_names
from pipeswap.swap.plan.tensors import SavedKey

__all__ = [
    "InnerSaves",
    "StepNames",
    "capture_inner",
    "capture_records",
    "kept_key",
    "resolve_layers",
    "step_names",
]


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
    """The named submodules that are the plan's layers; a LayeredModel's layers by default."""
    if layers is None:
        names = getattr(model, "layer_names", None)
        if names is None:
            raise PipeswapError(
                f"{type(model).__name__} names no layers of its own: pass its layers as a list of "
                f"submodule names in forward order, e.g. layers={candidate_layers(model)}"
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
    *,
    packed: set[int] | None = None,
    after: dict[str, list[int]] | None = None,
) -> tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]]:
    """Run ``forward_loss`` once (no backward) and name the tensors it saves per layer.

    Returns the profiler's records and, per layer, the name each pack call saved (None for
    a parameter or buffer). Buffers (BatchNorm statistics) and the random state are put
    back afterwards, so the pass leaves no trace on training. ``packed`` gets the storage
    keys of every saved storage (SavedTensorCapture.saved_keys), ``after`` the positions
    of the pack calls made after each layer's forward returned (after_calls).
    """
    capture = _capture(model, forward_loss, layers, None)
    if packed is not None:
        packed.update(capture.saved_keys)
    return _named(capture, after)


class InnerSaves:
    """What a recomputed layer's own forward saves, noted during a plain (tagged) pass.

    The executor starts each call of a recomputed layer's forward with :meth:`begin` (its
    tensor inputs) and sets :attr:`layer` back to None at its end; the capture notes every
    storage saved meanwhile, per call: a layer a forward calls several times (ALBERT's
    shared layer) re-runs each call right before that call's backward, one at a time.
    """

    def __init__(self) -> None:
        self.layer: str | None = None
        self.inputs: dict[str, list[set[int]]] = {}  # per layer, per call: its inputs' keys
        self.saved: dict[str, list[dict[int, int]]] = {}  # per layer, per call: key -> bytes
        self.owner: dict[int, str] = {}  # storage key -> the last layer that saved it
        # While a layer's operations are noted (pipeswap.swap.runtime.selective.OpRecorder):
        # its storages' ids, and what the layer saves by those ids -> bytes.
        self.identify: Callable[[torch.Tensor], int] | None = None
        self.saved_ids: dict[str, dict[int, int]] = {}
        # Per layer: bytes of the casts a step keeps once (pipeswap.profiling.cast_twins)
        # that the layer's forward saved again; its re-run keeps each.
        self.twin_bytes: dict[str, list[int]] = {}  # per call
        # Per layer: its modules' attributes its forward left holding a tensor that carries
        # the graph (pipeswap.swap.runtime.held_state): recomputing it frees nothing.
        self.held: dict[str, tuple[str, ...]] = {}
        # Per layer, per call: its output's storages that carry the graph -> (storage bytes,
        # gradient bytes).
        self.outputs: dict[str, list[dict[int, tuple[int, int]]]] = {}

    def begin(self, layer: str, inputs: set[int]) -> None:
        """A call of ``layer``'s forward starts, given the storages ``inputs``."""
        self.layer = layer
        self.inputs.setdefault(layer, []).append(inputs)
        self.saved.setdefault(layer, []).append({})
        self.twin_bytes.setdefault(layer, []).append(0)

    def returned(self, layer: str, output: Any) -> None:
        """The call of ``layer`` begun last returned ``output``."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        self.outputs.setdefault(layer, []).append(
            {
                storage_key(t): (t.untyped_storage().nbytes(), t.numel() * t.element_size())
                for t in tensors
                if t.requires_grad
            }
        )

    def output_bytes(self, layer: str) -> int:
        """What a re-run of ``layer`` holds for its output beyond what it saves and its
        forward's working set (the meter's reading, beyond every saved storage filed up to
        this layer): the output's gradient, which the backward starts with, where the layer
        owns its output (its own last op or the head's code saves it, and no later layer:
        its saved bytes counted it, and the working set had no room for it). Where a later
        layer owns it, or none, the working set read it alive, which covers the gradient.
        Of a layer called several times a forward, the most for one call."""
        most = 0
        for inputs, outputs in zip(self.inputs.get(layer, []), self.outputs.get(layer, [])):
            held = sum(
                gradient
                for key, (_, gradient) in outputs.items()
                if key not in inputs and self.owner.get(key) == layer
            )
            most = max(most, held)
        return most

    def rerun_bytes(self, layer: str, *, own: bool = False) -> int:
        """Bytes a re-run of ``layer`` saves anew: everything its forward saves except its
        inputs, which the recomputation wrapper keeps and the re-run saves again without a copy.

        With ``own``, only the storages the layer owns (as the profiler names them): not
        its output kept by its last op, which a later layer owns.

        A repeated cast (a normalised input cast for a query, a key and a value) counts
        each time: a step keeps it once, but the re-run runs inside ``torch.utils.checkpoint``,
        whose own saved-tensor hooks keep what it saves, every copy.

        Of a layer called several times a forward, the most one call's re-run saves.
        """
        calls = zip(
            self.inputs.get(layer, []), self.saved.get(layer, []), self.twin_bytes.get(layer, [])
        )
        return max(
            (
                twins
                + sum(
                    n
                    for key, n in saved.items()
                    if key not in inputs and (not own or self.owner.get(key) == layer)
                )
                for inputs, saved, twins in calls
            ),
            default=0,
        )


class _TaggingCapture(SavedTensorCapture):
    """SavedTensorCapture that also fills an :class:`InnerSaves`."""

    def __init__(self, view: _LayerView, inner: InnerSaves, resident: set[int]) -> None:
        super().__init__(view, release=True, drop_casts=True)  # type: ignore[arg-type]
        self._inner = inner
        self._resident_keys = resident

    def _pack(self, tensor: torch.Tensor) -> object:
        layer = self._inner.layer
        if self.layer is not None:
            given, tensor = tensor, self.twins.share(tensor)
            if layer is not None and storage_key(given) != storage_key(tensor):
                nbytes = given.untyped_storage().nbytes()
                self._inner.twin_bytes[layer][-1] += nbytes
        key = storage_key(tensor)
        if key not in self._resident_keys:
            if self.layer is not None:
                self._inner.owner[key] = self.layer  # forward order: the last one wins
            if layer is not None:
                nbytes = tensor.untyped_storage().nbytes()
                self._inner.saved[layer][-1][key] = nbytes
                if self._inner.identify is not None:
                    by_id = self._inner.saved_ids.setdefault(layer, {})
                    by_id[self._inner.identify(tensor)] = nbytes
        return super()._pack(tensor)


def capture_inner(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    layers: Sequence[str] | None,
    inner: InnerSaves,
    after: dict[str, list[int]] | None = None,
) -> tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]]:
    """:func:`capture_records`, also noting in ``inner`` what recomputed layers save."""
    return _named(_capture(model, forward_loss, layers, inner), after)


def _named(
    capture: SavedTensorCapture, after: dict[str, list[int]] | None
) -> tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]]:
    """A capture's records and pack calls; ``after`` gets its after_calls."""
    if after is not None:
        after.update(capture.after_calls)
    return capture.records(), capture.pack_calls()


def _capture(
    model: nn.Module,
    forward_loss: Callable[[], torch.Tensor],
    layers: Sequence[str] | None,
    inner: InnerSaves | None,
) -> SavedTensorCapture:
    resolved = resolve_layers(model, layers)
    view = _LayerView(model, resolved)
    # No backward follows: each saved tensor is let go of as the forward runs, so naming
    # a call holds no more than a planned step of it would (a new shape is named before
    # its first step, within the budget).
    if inner is None:
        capture = SavedTensorCapture(view, release=True, drop_casts=True)  # type: ignore[arg-type]
    else:
        resident = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        capture = _TaggingCapture(view, inner, resident)

    # The pass leaves no trace: buffers (BatchNorm statistics), modes and random state
    # are put back, as the profiler does.
    def called_with(module: nn.Module, args: Any, kwargs: Any) -> None:
        # What the loop called the model with, it holds through the step: never freed.
        capture.giving(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))

    handle = model.register_forward_pre_hook(called_with, with_kwargs=True)
    with untouched(model, check=False), capture:
        try:
            loss = forward_loss()
        finally:
            handle.remove()
        # What a loop may hold of the output beyond the backward (the loss aside): the saved
        # storages among its tensors are marked, as long as they are the output's.
        given = output_loss(loss)
        capture.returning(t for t in output_tensors(loss) if t is not given)
        del loss, given
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
    plain: tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]],
    recomputing: tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]],
    recompute: Sequence[str],
    after: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {}),
) -> StepNames:
    """Name the pack calls of a step with recomputed layers as the plan (the profiler)
    names tensors.

    ``plain`` is a capture of the forward as the profiler ran it, ``recomputing`` one
    with the recomputed layers wrapped for recomputation: their own saves vanish, their
    inputs are saved once more by the wrapper, and a storage may then change owner (a
    block's input saved by the previous block's last op and kept by the wrapper). Every
    other layer packs the same tensors in the same order in both passes, so zipping their
    pack calls maps each name of the recomputing pass to the plan's name; so does the code
    after a recomputed layer's forward (``after``: each pass's after_calls); what only
    recomputed layers save gets a :func:`kept_key` name.
    """
    records, calls = plain
    c_records, c_calls = recomputing
    skip = set(recompute)
    plan_name: dict[SavedKey, SavedKey] = {}
    for layer, mine in calls.items():
        theirs = c_calls[layer]
        if layer in skip:  # its own calls vanish; those of the code after it do not
            mine = [mine[i] for i in after[0].get(layer, [])]
            theirs = [theirs[i] for i in after[1].get(layer, [])]
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
    # (its input, kept by the wrapper; tensors of ops between it and the next layer).
    # A storage the loop or the model's own code holds anyway (given, kept_alive) is no
    # more held for the recomputation: the working sets count it where the meter read it.
    def held(captured: dict[str, list[CapturedSavedTensor]]) -> set[SavedKey]:
        return {
            (la, r.index) for la, recs in captured.items() for r in recs if r.held_anyway(False)
        }

    anyway = held(records) | {kept_key(*key) for key in held(c_records)}
    kept_bytes = dict.fromkeys(recompute, 0)
    for key in {key for keys in pack_calls.values() for key in keys if key is not None}:
        if owner[key] in kept_bytes and key not in anyway:
            kept_bytes[owner[key]] += sizes[key]
    return StepNames(pack_calls, sizes, kept_bytes)
