"""Recomputed layers in the swap runtime: each forward run again right before its backward.

Each recomputed layer's forward is wrapped for recomputation (non-reentrant
``torch.utils.checkpoint``) and re-run with its RNG states and buffers as they were.

Inside the wrapper its own saved-tensor hooks are innermost, so what the layer saves
never reaches the executor's hooks and is never swapped; the wrapper's copy of the
layer's input is packed by the executor's hooks, as a tensor of the layer, where it is
a tensor argument (an input nested in a tuple, or given by keyword, the wrapper holds by
reference: counted in ``kept_bytes`` all the same). The re-run in
the backward starts from the buffers the forward started from (spectral_norm's power
iteration reads them) and restores them afterwards (BatchNorm statistics are updated once
per step, as without recomputation: pipeswap.swap.runtime.forward_buffers), and on the CPU its saved bytes count from the
re-run to the end of the layer's backward.

A layer named ``selective`` is recomputed selectively (pipeswap.swap.runtime.selective):
it keeps, beside its input, the outputs of the operations dear to compute, and its re-run
runs only the rest. The plain pass of :meth:`Recomputation.capture` notes every wrapped
layer's operations and makes that choice for it (``choices``), so a plan can weigh both.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Collection
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

from pipeswap.profiling.saved import CapturedSavedTensor, storage_key
from pipeswap.swap.plan.tensors import SavedKey
from pipeswap.swap.runtime.attached import own_forward
from pipeswap.swap.runtime.capture import InnerSaves, capture_inner, capture_records, step_names
from pipeswap.swap.runtime.forward_buffers import ChangedBuffers, ForwardBuffers
from pipeswap.swap.runtime.held_state import graph_tensors, set_during
from pipeswap.swap.runtime.selective import (
    OpRecorder,
    SelectiveChoice,
    choose,
    context_fn,
    dispatch_seconds,
    mode_seconds_per_op,
)
from pipeswap.swap.runtime.transfer import DeviceLedger

__all__ = ["Capture", "Recomputation"]

Capture = tuple[dict[str, list[CapturedSavedTensor]], dict[str, list[SavedKey | None]]]


class _Wrapper:
    """A layer's forward as one Recomputation wrapped it: ``shadowed`` is the forward
    attribute it covers (None: the class's), ``inner`` the forward it calls once removed."""

    def __init__(
        self,
        module: nn.Module,
        recomputed: Callable[..., Any],
        inner: Callable[..., Any],
        shadowed: Any,
    ) -> None:
        self.module, self.recomputed, self.inner = module, recomputed, inner
        self.shadowed = shadowed
        self.removed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.inner if self.removed else self.recomputed)(*args, **kwargs)

    # A copy of the layer (deepcopy, torch.save) gets the forward it had before the wrapper.
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.shadowed is not None:
            return copy.deepcopy(self.shadowed, memo)
        return own_forward(memo.get(id(self.module), self.module))

    def __reduce__(self) -> tuple[Any, ...]:
        if self.shadowed is not None:
            return (_given, (self.shadowed,))
        return (own_forward, (self.module,))


def _given(forward: Any) -> Any:
    return forward


class Recomputation:
    """The layers a plan recomputes, on one model.

    ``install`` wraps each layer's forward (an instance attribute shadows the class's, so
    ``nn.Module.__call__`` and every module hook still run around it); ``remove`` puts
    them back. ``capture`` names what a step saves and measures, per layer, what it holds
    from forward to backward (``kept_bytes``) and what its re-run saves
    (``rerun_bytes``; ``own_rerun_bytes``: only what the layer owns, as the profiler
    names it). ``active`` is set while a step runs.
    """

    def __init__(
        self,
        layers: dict[str, nn.Module],
        names: list[str],
        ledger: DeviceLedger,
        account: bool,
        selective: Collection[str] = (),
    ) -> None:
        self.names = names
        self.selective = frozenset(selective) & set(names)
        self.choices: dict[str, SelectiveChoice] = {}  # per layer of ``choosing``, from capture
        self.choosing = self.selective  # the layers whose selective choice capture makes
        # capture's kept_bytes: each layer's as if recomputed alone (a profile's), not
        # this set's (a storage several recomputed layers are given, held by the first).
        self.alone = False
        # What selective checkpointing's dispatch adds per operation, measured on the first
        # layer chosen for (its kind repeats down a model's depth): None until then.
        self.mode_s: float | None = None
        self.layers = {name: layers[name] for name in names}
        self._ledger = ledger
        self._account = account
        self.kept_bytes: dict[str, int] = {}
        self.rerun_bytes: dict[str, int] = {}
        self.own_rerun_bytes: dict[str, int] = {}
        self.output_bytes: dict[str, int] = {}  # (capture.InnerSaves.output_bytes)
        self.held_state: dict[str, tuple[str, ...]] = {}  # pipeswap.swap.runtime.held_state
        self.active = False
        self.stepping = False  # from a step's start to its finish_step, its backward too
        self._inner: InnerSaves | None = None  # set while capture tags their saves
        self._by_reference: _ByReference | None = None  # set during capture's second pass
        self._live: dict[str, int] = {}  # re-run bytes held until the layer's backward ends
        self._cached: dict[str, int] = {}  # selective layers' kept outputs, until their backward
        self._done: set[str] = set()
        self._changed = ChangedBuffers()  # which buffers each layer's forward updates
        self._wrappers: dict[str, _Wrapper] = {}  # each layer's, while installed

    def install(self) -> None:
        for name, module in self.layers.items():
            shadowed = module.__dict__.get("forward")
            forward = module.forward
            wrapper = _Wrapper(module, self._wrapped(name, forward), forward, shadowed)
            self._wrappers[name] = module.forward = wrapper

    def remove(self) -> None:
        """Give each layer its forward back; where another Recomputation wrapped it since
        (several shapes' plans on one model, closed in any order), this one's wrapper
        passes calls through until that one is removed too."""
        for name, wrapper in self._wrappers.items():
            module = self.layers[name]
            wrapper.removed = True
            while isinstance(top := module.__dict__.get("forward"), _Wrapper) and top.removed:
                if top.shadowed is None:
                    del module.forward
                else:
                    module.forward = top.shadowed
        self._wrappers.clear()

    def capture(
        self, model: nn.Module, forward_loss: Callable[[], torch.Tensor], layer_names: list[str]
    ) -> tuple[Capture, dict[SavedKey, int]]:
        """Two passes: a plain one names the tensors as the plan does and notes what each
        recomputed layer saves; one with the layers wrapped for recomputation gives the pack
        calls of the steps.
        Returns the plain pass's records with the steps' pack calls, and every name's bytes."""
        inner = InnerSaves()
        self._inner = inner
        after: tuple[dict[str, list[int]], dict[str, list[int]]] = ({}, {})
        try:
            plain = capture_inner(model, forward_loss, layer_names, inner, after=after[0])
        finally:
            self._inner = None
        self.active = True
        self._by_reference = _ByReference(model, alone=self.alone)
        packed: set[int] = set()
        try:
            recomputed = capture_records(
                model, forward_loss, layer_names, packed=packed, after=after[1]
            )
            held = self._by_reference.bytes(packed)
        finally:
            self.active = False
            self._by_reference = None
            self.finish_step()  # no backward follows: what the pass kept is let go of
        names = step_names(plain, recomputed, self.names, after)
        self.kept_bytes = {name: n + held.get(name, 0) for name, n in names.kept_bytes.items()}
        self.rerun_bytes = {name: inner.rerun_bytes(name) for name in self.names}
        self.own_rerun_bytes = {name: inner.rerun_bytes(name, own=True) for name in self.names}
        self.output_bytes = {name: inner.output_bytes(name) for name in self.names}
        self.held_state = dict(inner.held)
        for name in self.selective:  # it keeps its dear outputs too, and re-runs the rest
            choice = self.choices[name]
            self.kept_bytes[name] += choice.cached_bytes
            self.rerun_bytes[name] = choice.rerun_bytes
            self.own_rerun_bytes[name] = min(self.own_rerun_bytes[name], choice.rerun_bytes)
        return (plain[0], names.pack_calls), names.sizes

    def name_step(
        self, model: nn.Module, forward_loss: Callable[[], torch.Tensor], layer_names: list[str]
    ) -> tuple[Capture, dict[SavedKey, int]]:
        """What a step saves, named as the plan names it, and every name's bytes: with
        recomputed layers :meth:`capture`'s two passes, else one plain pass."""
        if self.names:
            return self.capture(model, forward_loss, layer_names)
        records, pack_calls = capture_records(model, forward_loss, layer_names)
        sizes = {(layer, r.index): r.bytes for layer, recs in records.items() for r in recs}
        return (records, pack_calls), sizes

    def start_step(self) -> None:
        self._done = set()
        self.stepping = True

    def backward_done(self, name: str) -> None:
        """The layer's backward is done: what its re-run saved is let go of by now."""
        self._ledger.shrink(self._live.pop(name, 0) + self._cached.pop(name, 0))

    def finish_step(self) -> tuple[int, int]:
        """(layers re-run this step, bytes their re-runs saved). A layer whose input needs
        no gradient may have had its backward hook fire before its re-run: its re-run's
        bytes are let go of with the backward's end."""
        self.stepping = False
        for nbytes in (*self._live.values(), *self._cached.values()):
            self._ledger.shrink(nbytes)
        self._live.clear()
        self._cached.clear()
        return len(self._done), sum(self.rerun_bytes.get(name, 0) for name in self._done)

    def _wrapped(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        module = self.layers[name]

        def recomputed(*args: Any, **kwargs: Any) -> Any:
            inner = self._inner
            if inner is not None:  # capture's plain pass: note what the forward saves
                # Every tensor the layer is given, nested ones too (a rotary (cos, sin)
                # pair): the re-run saves them again without a copy.
                tensors = [
                    t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
                ]
                inner.begin(name, {storage_key(t) for t in tensors})
                recorder = OpRecorder() if name in self.choosing else nullcontext()
                if isinstance(recorder, OpRecorder):  # saves named as its operations name them
                    inner.identify = recorder.id_of
                    given = {
                        recorder.id_of(t)
                        for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and t.layout == torch.strided
                    }
                before = graph_tensors(module)
                try:
                    with recorder:
                        out = forward(*args, **kwargs)
                finally:
                    inner.layer, inner.identify = None, None
                inner.returned(name, out)
                if held := set_during(module, before):
                    inner.held[name] = held
                if not isinstance(recorder, OpRecorder):
                    return out
                # On a GPU the kernels hide selective checkpointing's dispatch; not on a CPU.
                calls = recorder.calls()
                dispatch_s = 0.0
                if not recorder.on_cuda:
                    if self.mode_s is None:
                        again = functools.partial(forward, *args, **kwargs)
                        self.mode_s = max(
                            dispatch_seconds(), mode_seconds_per_op(again, len(calls))
                        )
                    dispatch_s = self.mode_s
                saved = inner.saved_ids.pop(name, {})
                self.choices[name] = choose(calls, saved, given, dispatch_s=dispatch_s)
                return out
            # In a step's backward, a layer runs again inside the user's own checkpoint
            # (torch.utils.checkpoint, HF's gradient checkpointing): as in its forward, or
            # the saved tensors differ from the forward's and torch refuses the re-run.
            in_backward = self.stepping and torch._C._current_graph_task_id() != -1
            if not ((self.active or in_backward) and torch.is_grad_enabled()):
                return forward(*args, **kwargs)  # outside steps (evaluation): a plain forward
            if self._by_reference is not None:
                self._by_reference.note(name, args, kwargs)
            runs = 0
            found: ForwardBuffers | None = None  # the buffers as the forward found them

            def run(*args: Any, **kwargs: Any) -> Any:
                nonlocal runs, found
                runs += 1
                if runs == 1:
                    found = self._changed.before_forward(name, module)
                    out = forward(*args, **kwargs)
                    found.kept()
                    return out
                assert found is not None
                return self._rerun(
                    name, functools.partial(found.rerun, module, forward), args, kwargs
                )

            if name in self.selective:
                choice = self.choices[name]
                if self._account:
                    self._cached[name] = self._cached.get(name, 0) + choice.cached_bytes
                    self._ledger.grow(choice.cached_bytes)
                return checkpoint(
                    run,
                    *args,
                    use_reentrant=False,
                    preserve_rng_state=True,
                    context_fn=context_fn(choice.cached),
                    **kwargs,
                )
            # preserve_rng_state: the re-run starts from the CPU and CUDA generator states
            # the forward started from, so dropout draws the same masks.
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        return recomputed

    def _rerun(self, name: str, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """The layer's forward again, in the backward (``forward`` puts its buffers back as
        the first forward found them, and afterwards as they were: pipeswap's
        forward_buffers)."""
        if self._account and name not in self._live:
            self._live[name] = self.rerun_bytes.get(name, 0)
            self._ledger.grow(self._live[name])
        self._done.add(name)
        return forward(*args, **kwargs)


class _ByReference:
    """What each recomputed layer's checkpoint holds without saving it, noted in capture's
    pass with the layers wrapped: ``torch.utils.checkpoint`` saves a tensor argument through
    the saved-tensor hooks (which name it), but holds every other tensor it is given (a
    tensor in a tuple argument, a keyword argument) by reference until the layer's backward.
    A storage the pass saves too (a rotary (cos, sin) pair a layer that is not recomputed
    saves) is counted with that saved tensor, not here; parameters and buffers are resident
    anyway. A storage several layers are given (an attention mask) counts once, for the
    first (its backward comes last); with ``alone``, for each (what each holds when it is
    the one recomputed: a profile's per-layer bytes, the safe side for several)."""

    def __init__(self, model: nn.Module, *, alone: bool = False) -> None:
        self.resident = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.alone = alone
        self.given: dict[str, dict[int, int]] = {}  # per layer: storage key -> bytes
        self._refs: list[StorageWeakRef] = []  # keep each key unique until bytes()

    def note(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        nested = [a for a in args if not isinstance(a, torch.Tensor)]
        mine = self.given.setdefault(name, {})
        for t in tree_flatten((nested, kwargs))[0]:
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                continue
            key, others = storage_key(t), (mine,) if self.alone else self.given.values()
            if key in self.resident or any(key in keys for keys in others):
                continue
            storage = t.untyped_storage()
            self._refs.append(StorageWeakRef(storage))
            mine[key] = storage.nbytes()

    def bytes(self, packed: set[int]) -> dict[str, int]:
        """Per layer, the bytes held by reference that no saved tensor of the pass holds."""
        return {
            name: sum(n for key, n in keys.items() if key not in packed)
            for name, keys in self.given.items()
        }
