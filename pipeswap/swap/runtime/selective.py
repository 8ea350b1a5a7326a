"""Selective recomputation: inside a recomputed layer, keep what is dear to compute and
recompute what is cheap.

Whole-block recomputation (non-reentrant ``torch.utils.checkpoint``) keeps a layer's
input and runs its whole forward again before its backward: matmuls and attention too.
Most of the bytes a transformer block saves come from cheap operations (norms, casts,
activations, elementwise products, a rotary embedding), so the choice is made per tensor,
as torchtitan's op-level selective checkpointing and torch.compile's min-cut do:

* the output of every *dear* operation (a matmul, a convolution, attention) is kept,
  whether autograd saves it or a recomputed tensor needs it or the re-run would run it
  before it stops: recomputing one costs most of the layer's time;
* everything a cheap operation made is recomputed from the layer's input, parameters
  and the kept outputs.

:class:`OpRecorder` notes the operations of one plain forward of the layer, with the
storages each reads and writes and its time; :func:`choose` makes the choice and says
what it keeps, what the re-run saves again and what share of the forward's time the
re-run spends. The runtime applies it with torch's selective checkpointing
(:func:`context_fn`); operations are named as torch names them there, (op, n-th call).
Whatever the choice, the re-run computes the same bits: only the bytes and time differ.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

__all__ = [
    "DEAR_OPS",
    "OpCall",
    "OpName",
    "OpRecorder",
    "SelectiveChoice",
    "choose",
    "context_fn",
    "dispatch_seconds",
    "mode_seconds_per_op",
    "policy",
]

_aten = torch.ops.aten
# Dear to recompute: time grows with a product of dimensions, not with the bytes moved.
DEAR_OPS = frozenset(
    op.default
    for op in (
        _aten.mm,
        _aten.addmm,
        _aten.bmm,
        _aten.baddbmm,
        _aten._addmm_activation,
        _aten.convolution,
        _aten._convolution,
        _aten.cudnn_convolution,
        _aten.mkldnn_convolution,
        _aten._scaled_mm,
        _aten._scaled_dot_product_flash_attention,
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_cudnn_attention,
        _aten._efficient_attention_forward,
        _aten._flash_attention_forward,
    )
)

OpName = tuple[Any, int]  # (the op, its n-th call in the layer's forward), as SAC counts


@dataclass(frozen=True)
class OpCall:
    """One operation of a layer's forward: what it wrote and read, and its time."""

    name: OpName
    outputs: Mapping[int, int]  # storage key -> bytes
    inputs: frozenset[int]  # storage keys it read
    seconds: float
    dear: bool
    writes: bool  # in place or into an out= tensor (a view only aliases its input)


@dataclass(frozen=True)
class SelectiveChoice:
    """What a layer keeps and recomputes when it is recomputed selectively.

    ``cached``: the operations whose outputs are kept from the forward to the re-run;
    ``cached_bytes``: their bytes (device memory held through the step, beside the
    layer's input, which the recomputation keeps either way); ``rerun_bytes``: what the
    re-run saves anew; ``rerun_fraction``: the share of the forward's time the re-run
    spends (the operations it runs before it has every saved tensor back).
    """

    cached: frozenset[OpName]
    cached_bytes: int
    rerun_bytes: int
    rerun_fraction: float


class OpRecorder(TorchDispatchMode):
    """Notes each operation a forward runs, counted as torch's selective checkpointing
    counts them (the ops it ignores are ignored here too).

    Storages are named by :meth:`id_of`, one id per storage's lifetime: a storage freed
    and its key taken by a later one gets another id, so no output is held to keep two
    operations' tensors apart (the forward holds what a plain one does)."""

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[Any, int] = defaultdict(int)
        self._pending: list[tuple[OpName, dict[int, int], frozenset[int], Any, Any, bool]] = []
        self._lives: dict[int, tuple[StorageWeakRef, int]] = {}  # key -> (storage, its id)
        self._next_id = 0

    def id_of(self, tensor: torch.Tensor) -> int:
        """The id of the storage behind ``tensor`` (its lifetime's)."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = self._lives.get(key)
        if known is None or known[0].expired():
            self._next_id += 1
            known = self._lives[key] = (StorageWeakRef(storage), self._next_id)
        return known[1]

    def ids(self, tree: Any) -> dict[int, int]:
        """Every strided tensor's storage in ``tree``: id -> bytes."""
        found: dict[int, int] = {}
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided:
                try:
                    found[self.id_of(leaf)] = leaf.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):  # a subclass without one storage
                    continue
        return found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        inputs = frozenset(self.ids((args, kwargs)))
        cuda = any(
            isinstance(t, torch.Tensor) and t.is_cuda for t in tree_flatten((args, kwargs))[0]
        )
        if cuda:  # kernels run later: time them with events, read after a synchronize
            start: Any = torch.cuda.Event(enable_timing=True)
            end: Any = torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
        else:
            start = time.perf_counter()
            out = func(*args, **kwargs)
            end = time.perf_counter()
        name = (func, self._counts[func])
        self._counts[func] += 1
        self._pending.append((name, self.ids(out), inputs, start, end, cuda))
        return out

    @property
    def on_cuda(self) -> bool:
        return any(cuda for *_, cuda in self._pending)

    def calls(self) -> list[OpCall]:
        """The operations noted."""
        if self.on_cuda:
            torch.cuda.synchronize()
        return [
            OpCall(
                name,
                outputs,
                inputs,
                start.elapsed_time(end) / 1e3 if cuda else end - start,
                name[0] in DEAR_OPS,
                # torch names an operation's signature only so: writes in place or out=.
                bool(getattr(name[0], "_schema", None) and name[0]._schema.is_mutable),
            )
            for name, outputs, inputs, start, end, cuda in self._pending
        ]


def choose(
    calls: list[OpCall], saved: Mapping[int, int], inputs: set[int], *, dispatch_s: float = 0.0
) -> SelectiveChoice:
    """The selective choice for a layer whose forward ran ``calls``; ``saved``: the
    storages autograd saved in it (key -> bytes), ``inputs``: the layer's input storages;
    ``dispatch_s``: what selective checkpointing's dispatch costs per operation, in the
    forward and again in the re-run (:func:`dispatch_seconds`; 0 where the device's
    kernels hide it).

    The re-run stops once the last operation that saves a tensor for the backward has run
    (its kernel too unless kept: a matmul saves its input as it runs). Every dear
    operation up to there is kept, so no matmul runs twice; every other one runs again.
    """
    produced: set[int] = set()  # storages the layer's operations made (not its inputs)
    mutated: set[int] = set()  # written in place: a kept copy would go stale
    for call in calls:
        produced.update(key for key in call.outputs if key not in inputs)
        if call.writes:
            mutated.update(call.outputs)
    stop = max(
        (
            pos
            for pos, call in enumerate(calls)
            if call.dear or call.inputs & saved.keys() or saved.keys() & call.outputs.keys()
        ),
        default=-1,
    )
    cached = [
        pos
        for pos, call in enumerate(calls[: stop + 1])
        if call.dear and not mutated.intersection(call.outputs)
    ]
    kept = {key: n for pos in cached for key, n in calls[pos].outputs.items()}
    rerun_bytes = sum(n for key, n in saved.items() if key in produced and key not in kept)
    spent = sum(c.seconds for pos, c in enumerate(calls[: stop + 1]) if pos not in cached)
    spent += dispatch_s * (len(calls) + stop + 1)
    total = sum(call.seconds for call in calls)
    return SelectiveChoice(
        frozenset(calls[pos].name for pos in cached),
        sum(kept.values()),
        rerun_bytes,
        spent / total if total > 0 else 0.0,
    )


@functools.cache
def dispatch_seconds() -> float:
    """Seconds selective checkpointing adds to each operation on this CPU, in the forward
    (the caching mode) and the re-run (the cached one), against a plain call: measured
    once per process on a one-element tensor, the least of three tries."""
    x = torch.ones(1)
    count = 200

    def run() -> float:
        started = time.perf_counter()
        y = x
        for _ in range(count):
            y = torch.add(y, 1)
        return time.perf_counter() - started

    def with_modes() -> float:
        forward, rerun = create_selective_checkpoint_contexts(policy(frozenset()))
        with forward:
            first = run()
        with rerun:  # nothing kept: every call runs, through the cached mode's dispatch
            second = run()
        return (first + second) / 2

    plain = min(run() for _ in range(3))
    return max(0.0, min(with_modes() for _ in range(3)) - plain) / count


def mode_seconds_per_op(forward: Callable[[], Any], ops: int) -> float:
    """Seconds selective checkpointing's dispatch adds to each of the ``ops`` operations of
    ``forward`` (a layer's, run twice without gradients and twice in the caching mode: the
    least of each). Measured on the layer itself: in a Llama block on this CPU it was 12 us
    an operation, where :func:`dispatch_seconds`' one-element tensor reads 5."""

    def timed(mode: AbstractContextManager[Any]) -> float:
        with torch.no_grad(), mode:
            started = time.perf_counter()
            forward()
            return time.perf_counter() - started

    plain = min(timed(nullcontext()) for _ in range(2))
    caching = min(
        timed(create_selective_checkpoint_contexts(policy(frozenset()))[0]) for _ in range(2)
    )
    return max(0.0, caching - plain) / max(ops, 1)


def policy(cached: frozenset[OpName]) -> Callable[..., CheckpointPolicy]:
    """A selective-checkpointing policy that keeps the outputs of ``cached`` (counted per
    call of the layer's forward: make one per call)."""
    counts: dict[Any, int] = defaultdict(int)

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        index = counts[func]
        counts[func] += 1
        if (func, index) in cached:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def context_fn(cached: frozenset[OpName]) -> Callable[[], Any]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a layer with this choice."""
    return lambda: create_selective_checkpoint_contexts(policy(cached))
