"""Which tensors autograd saves for each layer's backward, named (layer, index).

The naming is a contract the swap runtime relies on:

- a *saved tensor* is a distinct storage that autograd keeps for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks``; parameters and buffers are excluded (they
  stay resident anyway). Storage identity is ``untyped_storage()._cdata`` (the address of
  the StorageImpl), which is exact on ``meta`` too, where every ``data_ptr()`` is 0;
- views of one storage count once, and its ``bytes`` are the storage's ``nbytes()`` (what
  is actually held, not the view's extent);
- a storage belongs to the layer whose backward needs it first: the *last* layer, in
  forward order, whose forward saved it. The input of a Linear produced by the previous
  block belongs to the Linear's layer; a block output saved both by its own final ReLU
  and by the next block's first conv belongs to the next block (backward reaches it there
  first), and the earlier layer lists it in ``also_saved_by`` of the owner's record;
- what the model's own code saves between two layers' forwards (a bridge between an
  encoder and a decoder) belongs to the later one: that code's backward runs after the
  later layer's, before the earlier layer's begins;
- ``index`` is the order of first appearance among the tensors a layer owns;
- tensors saved by the loss (after the last block) belong to the last layer, whose
  backward starts right after the loss's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from pipeswap.models.base import LayeredModel
from pipeswap.precision import drop_cached_casts
from pipeswap.profiling.cast_twins import CastTwins
from pipeswap.profiling.meta_attention import meta_attention_like_cpu

__all__ = [
    "CapturedSavedTensor",
    "SavedTensorCapture",
    "capture_saved",
    "storage_key",
]


@dataclass(frozen=True)
class CapturedSavedTensor:
    """One saved tensor as a capture sees it: a distinct storage autograd saves for ``layer``'s
    backward, with what the profile's :class:`~pipeswap.profiling.profile.SavedTensor` leaves
    out (its layer's name, shape, dtype, the earlier layers that saved it too, and whether
    the forward returned it)."""

    layer: str
    index: int
    bytes: int
    shape: tuple[int, ...]  # shape of the first view autograd saved
    dtype: str
    also_saved_by: tuple[str, ...] = ()  # earlier layers that saved it too (held once, here)
    # The storage is also one of the forward's outputs (SavedTensorCapture.returning): a
    # loop that holds its outputs through the backward keeps it on the device whatever a
    # plan does with the saved tensor.
    returned: bool = False
    # One of the tensors the model was called with (SavedTensorCapture.giving).
    given: bool = False
    # Held by the model's own code past the next layer's forward (a capture with
    # ``release``: BERT's embeddings output, kept while its encoder runs).
    kept_alive: bool = False

    def held_anyway(self, outputs_held: bool = True) -> bool:
        """Whether the loop or the model's code holds the storage whatever a plan does
        (its outputs only where ``outputs_held``): a swap of it frees nothing."""
        return self.given or self.kept_alive or (outputs_held and self.returned)


@dataclass
class _StorageSeen:
    # Held only while the capture runs, so that its address (our key) stays unique: the
    # storage itself, or (``release``) a weak reference, which keeps the address taken
    # while the bytes are freed.
    storage: torch.UntypedStorage | StorageWeakRef | None
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    savers: list[str]  # layers whose forward saved it, in order of first save


class _Packed:
    """What the pack hook hands autograd: the tensor, plus a finalizer for liveness."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# What autograd keeps of a saved tensor under SavedTensorCapture(release=True): nothing.
_RELEASED = object()


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of the storage behind ``tensor``; exact on every device, meta included."""
    return tensor.untyped_storage()._cdata


class SavedTensorCapture:
    """Context manager recording the tensors autograd saves while a LayeredModel runs.

    Inside it, calling the model (or its blocks one by one) records each pack by the block
    currently running (forward pre-hooks on the top-level blocks). After leaving it,
    :meth:`records` gives the named saved tensors. The hooks stay attached to the saved
    tensors, so :attr:`live_bytes` / :attr:`peak_live_bytes` keep tracking how many bytes
    of distinct saved storages are alive through the backward that follows.

    With ``release`` no backward may follow: autograd is handed a placeholder, not the
    tensor, so each saved tensor is freed as soon as the forward lets go of it, and the
    pass holds no more than a forward without gradients (a naming pass before a step
    that must keep a budget). With ``drop_casts`` autocast's cached casts are let go of at
    each layer's edge, as a swapping step lets go of them (pipeswap.precision).
    """

    def __init__(
        self, model: LayeredModel, *, release: bool = False, drop_casts: bool = False
    ) -> None:
        self.model = model
        self.release = release
        self.drop_casts = drop_casts  # at each layer's edge, as a swapping step does
        self.layer: str | None = None
        self._resident = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self._seen: dict[int, _StorageSeen] = {}
        self._order: dict[str, list[int]] = {name: [] for name in model.layer_names}
        self._packs: dict[str, list[int | None]] = {name: [] for name in model.layer_names}
        self._live_refs: dict[int, int] = {}
        self._live_bytes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self._handles: list[Any] = []
        self._hooks: Any = None
        self._final: dict[str, list[CapturedSavedTensor]] | None = None
        self._returned: set[int] = set()  # storage keys of the forward's outputs
        self._given: set[int] = set()  # storage keys of the tensors it was called with
        # (release) Per storage key, the place of the layer whose forward let go of it.
        self._places = {name: i for i, name in enumerate(model.layer_names)}
        self._died: dict[int, int] = {}
        self.twins = CastTwins()  # as the swap runtime keeps them: once
        # Storages saved since the running layer's forward returned: the next layer's once
        # its forward starts (the last layer's, the head's and the loss's, if none does).
        self._running = False
        self._after_layer: list[int] = []
        self.after_calls: dict[str, list[int]] = {name: [] for name in model.layer_names}

    # ---- hooks --------------------------------------------------------------------
    def _enter_layer(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self.layer is not None:
                self._note_deaths(self._places[self.layer])
            self.layer = name
            self._running = True
            for key in self._after_layer:
                self._saved_by(key, name)
            self._after_layer.clear()
            self.twins.reset()
            if self.drop_casts:
                drop_cached_casts()

        return hook

    def _leave_layer(self, module: nn.Module, args: Any, output: Any) -> None:
        self._running = False

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.layer is not None:
            tensor = self.twins.share(tensor)
        key = storage_key(tensor)
        if self.layer is not None and not self._running:  # (see after_calls)
            self.after_calls[self.layer].append(len(self._packs[self.layer]))
        if self.layer is None or key in self._resident:
            if self.layer is not None:
                self._packs[self.layer].append(None)
            return tensor.detach()  # a saved output as it is: the cycle below
        seen = self._seen.get(key)
        if seen is None:
            storage = tensor.untyped_storage()
            seen = _StorageSeen(
                StorageWeakRef(storage) if self.release else storage,
                storage.nbytes(),
                tuple(tensor.shape),
                str(tensor.dtype).removeprefix("torch."),
                [],
            )
            self._seen[key] = seen
        if self._running:
            self._saved_by(key, self.layer)
        elif key not in self._after_layer:
            self._after_layer.append(key)
        self._packs[self.layer].append(key)
        self._count_live(key, seen.bytes)
        if self.release:
            return _RELEASED
        # Detached: a saved output keeps its grad_fn, whose node keeps what we return, a
        # cycle through C++ that Python's collector cannot see. A forward with no backward
        # (prepare's naming pass) would then never free its saved tensors.
        packed = _Packed(tensor.detach())
        weakref.finalize(packed, self._release_live, key)
        return packed

    def _saved_by(self, key: int, layer: str) -> None:
        seen = self._seen[key]
        if layer not in seen.savers:
            seen.savers.append(layer)
            self._order[layer].append(key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if packed is _RELEASED:
            raise RuntimeError(
                "a backward through a forward run under SavedTensorCapture(release=True): "
                "its saved tensors were let go of as the forward ran"
            )
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _count_live(self, key: int, nbytes: int) -> None:
        refs = self._live_refs.get(key, 0)
        self._live_refs[key] = refs + 1
        if refs == 0:
            self._live_bytes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _release_live(self, key: int) -> None:
        refs = self._live_refs[key] - 1
        self._live_refs[key] = refs
        if refs == 0:
            self.live_bytes -= self._live_bytes.pop(key)
            del self._live_refs[key]

    def __enter__(self) -> SavedTensorCapture:
        for name, block in self.model.named_children():
            self._handles.append(block.register_forward_pre_hook(self._enter_layer(name)))
            self._handles.append(block.register_forward_hook(self._leave_layer))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.layer is not None:
            self._note_deaths(self._places[self.layer])
            for key in self._after_layer:  # after the last layer: its own (the loss's)
                self._saved_by(key, self.layer)
            self._after_layer.clear()
        self._hooks.__exit__(*exc)
        self.twins.reset()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._final = self._build_records()
        for seen in self._seen.values():
            seen.storage = None

    def returning(self, tensors: Iterable[torch.Tensor]) -> None:
        """Note tensors the forward returns (while the capture runs, so that storage keys
        are still unique): each saved storage among theirs is ``returned`` in its record."""
        self._returned.update(storage_key(t) for t in tensors)

    def giving(self, tensors: Iterable[torch.Tensor]) -> None:
        """Note the tensors the model is called with (while the capture runs): each saved
        storage among theirs is ``given`` in its record."""
        self._given.update(storage_key(t) for t in tensors)

    # ---- results ------------------------------------------------------------------
    def _owner(self, key: int) -> str:
        return self._seen[key].savers[-1]

    def _note_deaths(self, place: int) -> None:
        """(release) The storages let go of by now, noted as let go of at ``place``."""
        if not self.release:
            return
        for key, seen in self._seen.items():
            weak = seen.storage
            if key not in self._died and isinstance(weak, StorageWeakRef) and weak.expired():
                self._died[key] = place

    def _kept_alive(self, key: int, layer: str) -> bool:
        """Whether the forward's code held the storage past the layer after ``layer``'s."""
        died = self._died.get(key, len(self._places))  # alive at the end: past the last
        return self.release and died >= self._places[layer] + 2

    def _build_records(self) -> dict[str, list[CapturedSavedTensor]]:
        records: dict[str, list[CapturedSavedTensor]] = {}
        for layer, keys in self._order.items():
            owned = [key for key in keys if self._owner(key) == layer]
            records[layer] = [
                CapturedSavedTensor(
                    layer=layer,
                    index=index,
                    bytes=self._seen[key].bytes,
                    shape=self._seen[key].shape,
                    dtype=self._seen[key].dtype,
                    also_saved_by=tuple(self._seen[key].savers[:-1]),
                    returned=key in self._returned,
                    given=key in self._given,
                    kept_alive=self._kept_alive(key, layer),
                )
                for index, key in enumerate(owned)
            ]
        return records

    @property
    def saved_keys(self) -> frozenset[int]:
        """The storage keys of every saved storage seen (unique while the capture runs)."""
        return frozenset(self._seen)

    def records(self) -> dict[str, list[CapturedSavedTensor]]:
        """Saved tensors per layer name (every layer present, in forward order)."""
        if self._final is None:
            raise RuntimeError("SavedTensorCapture.records() is available after the with-block")
        return self._final

    def pack_calls(self) -> dict[str, list[tuple[str, int] | None]]:
        """For each layer, its pack calls in order: the (owner layer, index) each one saved,
        or None for a parameter or buffer. The swap runtime uses it to find its tensors.
        A layer's pack calls run from its forward's start to the next layer's: those made
        after its forward returned (the code between two layers, whose storages the next
        layer owns) are at the positions ``after_calls[layer]`` lists."""
        records = self.records()
        index_of = {}
        for layer, recs in records.items():
            owned = [key for key in self._order[layer] if self._owner(key) == layer]
            for key, rec in zip(owned, recs):
                index_of[key] = (layer, rec.index)
        return {
            layer: [None if key is None else index_of[key] for key in keys]
            for layer, keys in self._packs.items()
        }


def capture_saved(
    model: LayeredModel, inputs: torch.Tensor, targets: torch.Tensor | None = None
) -> dict[str, list[CapturedSavedTensor]]:
    """Run one forward (and the loss, if ``targets``) and name the tensors saved per layer.

    Works on any device; on ``meta`` attention is run the way the CPU would run it (see
    :func:`meta_attention_like_cpu`) so meta and CPU agree tensor by tensor.
    """
    with meta_attention_like_cpu(), SavedTensorCapture(model) as capture:
        output = model(inputs)
        if targets is not None:
            model.loss(output, targets)
    return capture.records()
