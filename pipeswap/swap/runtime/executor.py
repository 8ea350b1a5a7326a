"""SwapExecutor: applies one rank's part of a SwapPlan to real training steps, on CPU or CUDA.

A step runs as::

    executor.prepare(lambda: loss_of(model(x), y))   # once: names the saved tensors
    with executor.forward():                         # saved tensors are caught in here
        loss = loss_of(ddp_model(x), y)
    loss.backward()                                  # prefetches run at the plan's points
    stats = executor.finish_step()

Saved tensors are named (layer, index) exactly as the profiler names them: ``prepare``
runs one forward under :class:`pipeswap.profiling.saved.SavedTensorCapture` and keeps, per
layer, which named tensor each pack call saves; every later step's pack calls are matched
to that list by position. Parameters and buffers are never swapped (the capture excludes
them). A swapped storage is copied whole into its slot of a :class:`HostPool` on a side
stream; the executor drops its device reference only once the copy's event has completed.
Prefetches run on their own stream from module full backward hooks; the backward waits on
their events, and a tensor unpacked before its prefetch was issued is fetched there and
then and counted as a late fetch. On the CPU the streams are no-ops and the executor
counts the bytes of saved tensors held on the "device", so tests can check the budget.
This module decides when to move what (hooks, steps); :mod:`pipeswap.swap.runtime.transfer` moves
the bytes and keeps the stream and event rules.

Layers the plan recomputes run their forward under non-reentrant
``torch.utils.checkpoint`` (RNG states kept, so dropout draws the same masks again).
Inside it the checkpoint's own saved-tensor hooks are innermost, so what the layer saves
never reaches the executor's hooks and is never swapped; the checkpoint's copy of the
layer's input is packed by the executor's hooks, as a tensor of the layer (kept resident
unless the plan swaps that storage under the name it has without recomputation). The
re-run in the backward restores the layer's buffers afterwards (BatchNorm statistics are
updated once per step, as without recomputation), and on the CPU its saved bytes count
from the re-run to the end of the layer's backward.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeswap.errors import PipeswapError
from pipeswap.profile import Profile
from pipeswap.profiling.saved import SavedRecord
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.runtime.capture import (
    InnerSaves,
    SavedKey,
    capture_inner,
    capture_records,
    check_budget,
    check_plan_identity,
    check_records,
    checked_decisions,
    checked_recompute,
    issue_points,
    rank_plan,
    resolve_layers,
    step_names,
)
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.transfer import (
    ON_DEVICE,
    DeviceLedger,
    HeldTensor,
    SavedEntry,
    SwappedHandle,
    SwapTransfer,
    bytes_of_storage,
)

# On a layer whose input needs no gradient (the first), a full backward hook fires once its
# output gradient is ready, which is harmless here (earlier than planned); PyTorch warns.
warnings.filterwarnings(
    "ignore", message="Full backward hook is firing when gradients are computed with respect to"
)


@dataclass(frozen=True)
class StepStats:
    """What one executor step did (one micro-batch's forward and backward)."""

    peak_saved_bytes: int  # most bytes of saved tensors held on the device at once
    swapped_bytes: int  # bytes copied to the host pool
    prefetched_bytes: int  # bytes copied back (prefetched or fetched late)
    late_fetches: int  # tensors unpacked before their prefetch was issued
    seconds: float
    recomputed_layers: int = 0  # layers whose forward was run again in the backward
    recomputed_bytes: int = 0  # bytes those re-runs saved (as measured by prepare)

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_saved_bytes": self.peak_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "prefetched_bytes": self.prefetched_bytes,
            "late_fetches": self.late_fetches,
            "seconds": self.seconds,
            "recomputed_layers": self.recomputed_layers,
            "recomputed_bytes": self.recomputed_bytes,
        }


class SwapExecutor:
    """Runs training steps of ``model`` with rank ``rank``'s part of ``plan`` applied.

    ``layers`` names the plan's layers as submodules of ``model`` (a zoo model's blocks by
    default). ``profile`` (optional) lets the executor check the plan was made for this
    model and dtype, and gives the resident bytes and working sets that the budget
    check counts. ``account`` (default: on the CPU only) counts the bytes of every saved
    tensor held on the device (:attr:`live_bytes`, :attr:`peak_saved_bytes`); without it
    only swapped tensors are counted. The executor registers its module hooks (and wraps
    the forward of each recomputed layer) at construction; call :meth:`close`, or use it
    as a context manager, to remove them.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: SwapPlan,
        *,
        rank: int = 0,
        layers: Sequence[str] | None = None,
        profile: Profile | None = None,
        device: torch.device | str | None = None,
        account: bool | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.gpu_plan = rank_plan(plan, rank)
        self.rank = rank
        self.profile = profile
        self.layers = resolve_layers(model, layers)
        self.layer_names = list(self.layers)
        if device is None:
            first = next(model.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Streams, events and fetched bytes must all be on the model's GPU, not on
            # whichever one happens to be current when a hook runs.
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Counting every saved tensor costs a finalizer per tensor; CUDA has its allocator's
        # statistics instead, so by default only the CPU counts.
        self.account = self.device.type == "cpu" if account is None else account
        check_plan_identity(plan, model, self.layer_names, profile)
        self.decisions = checked_decisions(self.gpu_plan, self.layer_names)
        self.recompute = checked_recompute(self.gpu_plan, self.layers)
        self.pool = HostPool(
            ((key, d.bytes) for key, d in self.decisions.items()),
            pin=self.device.type == "cuda",
        )
        self._ledger = DeviceLedger()
        self._transfer = SwapTransfer(self.pool, self.device, self._ledger)
        points = issue_points(self.decisions, self.layer_names)
        self._outs_after, self._outs_at_turn, self._prefetch_after, self._prefetch_at_turn = points
        self._previous_layer = dict(zip(self.layer_names[1:], self.layer_names))
        self._ended: set[str] = set()
        self._pack_calls: dict[str, list[SavedKey | None]] | None = None
        self._sizes: dict[SavedKey, int] = {}
        self.records: dict[str, list[SavedRecord]] | None = None
        # Recomputation: per recomputed layer, what it holds from forward to backward and
        # what its re-run saves (both measured by prepare); the re-runs of this step.
        self.kept_bytes: dict[str, int] = {}
        self.rerun_bytes: dict[str, int] = {}
        self._own_rerun_bytes: dict[str, int] = {}
        # The most bytes a step needs by the plan's memory model (resident state, saved
        # tensors, working sets), as prepare checked it against the budget.
        self.needed_bytes: int | None = None
        self._checkpointing = False  # recomputed layers run under checkpoint (steps)
        self._inner: InnerSaves | None = None  # set while prepare tags their saves
        self._rerun_live: dict[str, int] = {}
        self._rerun_done: set[str] = set()
        self._active = False
        self._layer: str | None = None
        self._calls: dict[str, int] = {}
        self._entries: dict[SavedKey, SavedEntry] = {}
        self._reset_step_counters()
        self.late_fetches = 0
        self.swapped_bytes = 0
        self.steps = 0
        self._handles: list[Any] = []
        self._forwards: dict[str, Any] = {}  # recomputed layers' own forward attributes
        self._install_hooks()

    # ---- set-up ---------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        """Bytes of saved tensors held on the device now (only swapped ones without account)."""
        return self._ledger.live_bytes

    @property
    def peak_saved_bytes(self) -> int:
        """The most :attr:`live_bytes` over every step so far."""
        return self._ledger.peak_bytes

    @property
    def budget_bytes(self) -> int:
        return self.gpu_plan.budget_bytes

    @property
    def resident_bytes(self) -> int:
        """Parameters, gradients and optimizer state, as the profile counts them (0 without)."""
        return 0 if self.profile is None else self.profile.resident_bytes

    @property
    def saved_budget_bytes(self) -> int:
        """The most bytes of saved tensors the budget leaves room for at any moment."""
        return self.budget_bytes - self.resident_bytes

    def _install_hooks(self) -> None:
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_pre_hook(self._forward_pre_hook(name)))
            if name in self._prefetch_after or name in self.recompute:
                # Fires once the gradients of the layer's inputs are computed: its backward is
                # done, including the ops run after it that the profiler counts as its own
                # (they come first in backward). A pre-hook on the layer before would miss those.
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        for name in self.recompute:
            module = self.layers[name]
            # An instance attribute shadows the class's forward; nn.Module.__call__ (and so
            # the executor's and the user's module hooks) still runs around it.
            self._forwards[name] = module.__dict__.get("forward")
            module.forward = self._recomputed_forward(name, module.forward)

    def close(self) -> None:
        """Remove the executor's hooks (and recomputation wrappers) from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for name, previous in self._forwards.items():
            module = self.layers[name]
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._forwards.clear()

    def __enter__(self) -> SwapExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(self, forward_loss: Callable[[], torch.Tensor]) -> None:
        """Name the saved tensors with one forward of ``forward_loss`` and check the plan.

        ``forward_loss`` must run the same forward and loss as the training steps (same
        shapes); call it on the bare model, not its DDP replica (pipeswap.dist.ddp).
        """
        if self.recompute:
            records, pack_calls = self._capture_recomputed(forward_loss)
        else:
            records, pack_calls = capture_records(self.model, forward_loss, self.layer_names)
            self._sizes = {
                (layer, r.index): r.bytes for layer, recs in records.items() for r in recs
            }
        check_records(self.decisions, records)
        self.records = records
        if not self.account:  # tensors that stay need no bookkeeping: pass them straight on
            pack_calls = {
                layer: [key if key in self.decisions else None for key in keys]
                for layer, keys in pack_calls.items()
            }
        self._pack_calls = pack_calls
        self._check_budget(records)

    def _capture_recomputed(
        self, forward_loss: Callable[[], torch.Tensor]
    ) -> tuple[dict[str, list[SavedRecord]], dict[str, list[SavedKey | None]]]:
        """Two passes: a plain one names the tensors as the plan does and notes what each
        recomputed layer saves; one under checkpoint gives the pack calls of the steps."""
        inner = InnerSaves()
        self._inner = inner
        try:
            plain = capture_inner(self.model, forward_loss, self.layer_names, inner)
        finally:
            self._inner = None
        self._checkpointing = True
        try:
            checkpointed = capture_records(self.model, forward_loss, self.layer_names)
        finally:
            self._checkpointing = False
        names = step_names(plain, checkpointed, self.recompute)
        self._sizes = names.sizes
        self.kept_bytes = names.kept_bytes
        self.rerun_bytes = {name: inner.rerun_bytes(name) for name in self.recompute}
        self._own_rerun_bytes = {name: inner.rerun_bytes(name, own=True) for name in self.recompute}
        return plain[0], names.pack_calls

    def _check_budget(self, records: dict[str, list[SavedRecord]]) -> None:
        """Refuse a plan whose budget cannot hold this run's saved tensors and state."""
        transient = [0] * len(self.layer_names)
        rerun = self.rerun_bytes
        profile = self.profile
        if profile is not None and profile.layer_names == self.layer_names:
            transient = [la.workspace_bytes + la.output_bytes for la in profile.layers]
            # As in the planner's model: a re-run's copy of its output (saved by its last
            # op, owned by the next layer) takes the room its working set has for it.
            rerun = self._own_rerun_bytes
        self.needed_bytes = check_budget(
            self.gpu_plan,
            self.decisions,
            records,
            self.layer_names,
            resident_bytes=self.resident_bytes,
            transient=transient,
            device=self.device,
            kept_bytes=self.kept_bytes,
            rerun_bytes=rerun,
        )

    # ---- hooks ----------------------------------------------------------------------
    def _forward_pre_hook(self, name: str) -> Callable[..., None]:
        # A layer's forward ends where the next one starts: whatever runs in between (an
        # activation outside any listed submodule) belongs to it, as in the profiler.
        previous = self._previous_layer.get(name)

        def hook(module: nn.Module, args: Any) -> None:
            if not self._active:
                return
            if previous is not None and previous not in self._ended:
                self._end_forward(previous)
            self._layer = name
            self._transfer.poll()

        return hook

    def _end_forward(self, name: str) -> None:
        self._ended.add(name)
        for key in self._outs_after.get(name, ()):
            self._swap_out(key)

    def _backward_hook(self, name: str) -> Callable[..., None]:
        prefetches = self._prefetch_after.get(name, [])

        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            # The layer's backward is done: what its re-run saved is let go of by now.
            self._ledger.shrink(self._rerun_live.pop(name, 0))
            for key in prefetches:
                self._prefetch(key)

        return hook

    # ---- recomputation ----------------------------------------------------------------
    def _recomputed_forward(self, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        module = self.layers[name]

        def recomputed(*args: Any, **kwargs: Any) -> Any:
            inner = self._inner
            if inner is not None:  # prepare's plain pass: note what the forward saves
                inner.layer = name
                inner.inputs[name] = {
                    t.untyped_storage()._cdata
                    for t in (*args, *kwargs.values())
                    if isinstance(t, torch.Tensor)
                }
                try:
                    return forward(*args, **kwargs)
                finally:
                    inner.layer = None
            if not (self._checkpointing and torch.is_grad_enabled()):
                return forward(*args, **kwargs)  # outside steps (evaluation): a plain forward
            runs = 0

            def run(*args: Any, **kwargs: Any) -> Any:
                nonlocal runs
                runs += 1
                if runs == 1:
                    return forward(*args, **kwargs)
                return self._rerun(name, module, forward, args, kwargs)

            # preserve_rng_state: the re-run starts from the CPU and CUDA generator states
            # the forward started from, so dropout draws the same masks.
            return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        return recomputed

    def _rerun(
        self, name: str, module: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any
    ) -> Any:
        """The layer's forward again, in the backward; its buffers are left as they were."""
        if self.account and name not in self._rerun_live:
            self._rerun_live[name] = self.rerun_bytes.get(name, 0)
            self._ledger.grow(self._rerun_live[name])
        self._rerun_done.add(name)
        # A training-mode BatchNorm would update its running statistics a second time.
        buffers = [(b, b.detach().clone()) for b in module.buffers()]
        try:
            return forward(*args, **kwargs)
        finally:  # also when the checkpoint stops the re-run early (all it needs is saved)
            with torch.no_grad():
                for buffer, values in buffers:
                    buffer.copy_(values)

    def _pack(self, tensor: torch.Tensor) -> Any:
        layer = self._layer
        if layer is None:
            return tensor
        call = self._calls[layer]
        self._calls[layer] = call + 1
        try:
            key = self._pack_calls[layer][call]  # type: ignore[index]
        except IndexError:
            raise PipeswapError(
                f"layer {layer!r} saved more tensors than in the prepare() pass; a step must "
                "run the same forward and shapes as the one prepare() was given"
            ) from None
        if key is None:  # a parameter or buffer: always resident, never swapped
            return tensor
        entry = self._entries.get(key)
        if entry is None:
            entry = self._new_entry(key, tensor)
        if entry.swapped:
            return SwappedHandle(self._transfer, entry, tensor)
        return HeldTensor(self._transfer, entry, tensor)

    def _new_entry(self, key: SavedKey, tensor: torch.Tensor) -> SavedEntry:
        if key in self.decisions:
            storage = bytes_of_storage(tensor)
            if storage.numel() != self.decisions[key].bytes:
                raise PipeswapError(
                    f"tensor {key} has {storage.numel()} bytes in this step but "
                    f"{self.decisions[key].bytes} in the plan; steps must keep their shapes"
                )
            entry = SavedEntry(key, storage.numel(), True, storage)
        else:
            entry = SavedEntry(key, self._sizes[key], False, None)
        self._entries[key] = entry
        self._ledger.grow(entry.nbytes)
        return entry

    def _unpack(self, handle: Any) -> torch.Tensor:
        if type(handle) is HeldTensor:
            return handle.tensor
        if type(handle) is not SwappedHandle:
            return handle
        entry = handle.entry
        if self._transfer.ready(entry):
            self.late_fetches += 1
            self._step_late += 1
            self._step_prefetched += entry.nbytes
        assert entry.device is not None
        rebuilt = torch.empty(0, dtype=handle.dtype, device=entry.device.device)
        return rebuilt.set_(
            entry.device.untyped_storage(), handle.offset, handle.size, handle.stride
        )

    # ---- moving bytes -----------------------------------------------------------------
    def _swap_out(self, key: SavedKey) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.state != ON_DEVICE:
            raise PipeswapError(
                f"the plan swaps tensor {key} out but this step did not save it; prepare() "
                "must see the same forward as the steps"
            )
        self._transfer.swap_out(entry)
        self.swapped_bytes += entry.nbytes
        self._step_swapped += entry.nbytes

    def _prefetch(self, key: SavedKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and self._transfer.prefetch(entry):
            self._step_prefetched += entry.nbytes

    # ---- steps ----------------------------------------------------------------------
    def _reset_step_counters(self) -> None:
        self._ledger.start_step()
        self._step_swapped = 0
        self._step_prefetched = 0
        self._step_late = 0
        self._rerun_done = set()
        self._step_started = time.perf_counter()

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run the forward and loss of one step inside; the turn happens on exit."""
        if self._pack_calls is None:
            raise PipeswapError("call SwapExecutor.prepare(forward_loss) before the first step")
        if self._active:
            raise PipeswapError("SwapExecutor.forward() does not nest; finish the step first")
        self._entries = {}
        self._calls = dict.fromkeys(self.layer_names, 0)
        self._ended = set()
        self._layer = None
        self._reset_step_counters()
        self._active = True
        self._checkpointing = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
            self._checkpointing = False
            self._layer = None
        self._turn()

    def _turn(self) -> None:
        for name in self.layer_names[:-1]:
            if name not in self._ended:  # a layer the forward skipped: end it now
                self._end_forward(name)
        for key in self._outs_at_turn:
            self._swap_out(key)
        self._transfer.poll()
        for key in self._prefetch_at_turn:
            self._prefetch(key)

    def finish_step(self) -> StepStats:
        """Call after the backward: settles the copies and returns the step's numbers."""
        self._transfer.poll()
        # A layer whose input needs no gradient may have had its backward hook fire before
        # its re-run: its re-run's bytes are let go of with the backward's end.
        for nbytes in self._rerun_live.values():
            self._ledger.shrink(nbytes)
        self._rerun_live.clear()
        self.steps += 1
        return StepStats(
            peak_saved_bytes=self._ledger.step_peak_bytes,
            swapped_bytes=self._step_swapped,
            prefetched_bytes=self._step_prefetched,
            late_fetches=self._step_late,
            seconds=time.perf_counter() - self._step_started,
            recomputed_layers=len(self._rerun_done),
            recomputed_bytes=sum(self.rerun_bytes.get(name, 0) for name in self._rerun_done),
        )

    def train_step(
        self, forward_loss: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, StepStats]:
        """Forward, loss and backward of one micro-batch; prepares on first use."""
        if self._pack_calls is None:
            self.prepare(forward_loss)
        with self.forward():
            loss = forward_loss()
        loss.backward()
        return loss.detach(), self.finish_step()
