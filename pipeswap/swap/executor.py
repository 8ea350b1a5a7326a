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
This module decides when to move what (hooks, steps); :mod:`pipeswap.swap.transfer` moves
the bytes and keeps the stream and event rules.
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

from pipeswap.errors import PipeswapError
from pipeswap.profile import Profile
from pipeswap.profiling.saved import SavedRecord
from pipeswap.swap.capture import (
    SavedKey,
    capture_records,
    check_budget,
    check_plan_identity,
    check_records,
    checked_decisions,
    issue_points,
    rank_plan,
    resolve_layers,
)
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.pool import HostPool
from pipeswap.swap.transfer import (
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

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_saved_bytes": self.peak_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "prefetched_bytes": self.prefetched_bytes,
            "late_fetches": self.late_fetches,
            "seconds": self.seconds,
        }


class SwapExecutor:
    """Runs training steps of ``model`` with rank ``rank``'s part of ``plan`` applied.

    ``layers`` names the plan's layers as submodules of ``model`` (a zoo model's blocks by
    default). ``profile`` (optional) lets the executor check the plan was made for this
    model and dtype, and gives the resident bytes and working sets that the budget
    check counts. ``account`` (default: on the CPU only) counts the bytes of every saved
    tensor held on the device (:attr:`live_bytes`, :attr:`peak_saved_bytes`); without it
    only swapped tensors are counted. The executor registers its module hooks at
    construction; call :meth:`close` to remove them.
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
        self._active = False
        self._layer: str | None = None
        self._calls: dict[str, int] = {}
        self._entries: dict[SavedKey, SavedEntry] = {}
        self._reset_step_counters()
        self.late_fetches = 0
        self.swapped_bytes = 0
        self.steps = 0
        self._handles: list[Any] = []
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
            if name in self._prefetch_after:
                # Fires once the gradients of the layer's inputs are computed: its backward is
                # done, including the ops run after it that the profiler counts as its own
                # (they come first in backward). A pre-hook on the layer before would miss those.
                self._handles.append(module.register_full_backward_hook(self._backward_hook(name)))

    def close(self) -> None:
        """Remove the executor's hooks from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def prepare(self, forward_loss: Callable[[], torch.Tensor]) -> None:
        """Name the saved tensors with one forward of ``forward_loss`` and check the plan.

        ``forward_loss`` must run the same forward and loss as the training steps (same
        shapes); call it on the bare model, not a DistributedDataParallel wrapper.
        """
        records, pack_calls = capture_records(self.model, forward_loss, self.layer_names)
        check_records(self.decisions, records)
        self.records = records
        self._sizes = {(layer, r.index): r.bytes for layer, recs in records.items() for r in recs}
        if not self.account:  # tensors that stay need no bookkeeping: pass them straight on
            pack_calls = {
                layer: [key if key in self.decisions else None for key in keys]
                for layer, keys in pack_calls.items()
            }
        self._pack_calls = pack_calls
        self._check_budget(records)

    def _check_budget(self, records: dict[str, list[SavedRecord]]) -> None:
        """Refuse a plan whose budget cannot hold this run's saved tensors and state."""
        transient = [0] * len(self.layer_names)
        profile = self.profile
        if profile is not None and profile.layer_names == self.layer_names:
            transient = [la.workspace_bytes + la.output_bytes for la in profile.layers]
        check_budget(
            self.gpu_plan, self.decisions, records, self.layer_names,
            resident_bytes=self.resident_bytes, transient=transient, device=self.device,
        )  # fmt: skip

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
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            for key in self._prefetch_after[name]:
                self._prefetch(key)

        return hook

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
        return rebuilt.set_(entry.device.untyped_storage(), handle.offset, handle.size, handle.stride)

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
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._active = False
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
        self.steps += 1
        return StepStats(
            peak_saved_bytes=self._ledger.step_peak_bytes,
            swapped_bytes=self._step_swapped,
            prefetched_bytes=self._step_prefetched,
            late_fetches=self._step_late,
            seconds=time.perf_counter() - self._step_started,
        )

    def train_step(self, forward_loss: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, StepStats]:
        """Forward, loss and backward of one micro-batch; prepares on first use."""
        if self._pack_calls is None:
            self.prepare(forward_loss)
        with self.forward():
            loss = forward_loss()
        loss.backward()
        return loss.detach(), self.finish_step()
