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
to that list by position (a repeated cast is kept once, :mod:`pipeswap.profiling.cast_twins`,
in the naming pass as in the steps). Parameters and buffers are never swapped. A swapped
storage is copied whole into its region of a :class:`HostPool`; prefetches start from
hooks on gradients (:mod:`pipeswap.swap.runtime.prefetch_gate`, or the turn's); a tensor
unpacked before its prefetch was issued is fetched then, a late fetch (the bytes move by
:mod:`pipeswap.swap.runtime.transfer`; on the CPU a fetch copies too).

Layers the plan recomputes run their forward under non-reentrant ``torch.utils.checkpoint``
(:mod:`pipeswap.swap.runtime.recompute`); the wrapper's copy of a layer's input is packed by
the executor's hooks, as a tensor of the layer (kept resident unless the plan swaps that
storage under the name it has without recomputation).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.measured import measured_memory
from pipeswap.swap.runtime.attached import AttachedHook
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.checks import (
    check_plan_identity,
    check_records,
    checked_decisions,
    checked_recompute,
    forward_need,
    issue_points,
    rank_plan,
    step_budget,
    step_refusal,
)
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.prefetch_gate import PrefetchGate
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.swap.runtime.step_tensors import StepTensors, only_swapped
from pipeswap.swap.runtime.transfer import DeviceLedger, SwapTransfer

__all__ = ["SwapExecutor"]


class SwapExecutor:
    """Runs training steps of ``model`` with rank ``rank``'s part of ``plan`` applied.

    ``layers`` names the plan's layers as submodules of ``model`` (a LayeredModel's layers
    by default). ``profile`` (optional) lets the executor check the plan was made for this
    model and dtype, and gives the resident bytes and working sets that the budget
    check counts. ``account`` (default: on the CPU only) counts the bytes of every saved
    tensor held on the device (:attr:`live_bytes`, :attr:`peak_saved_bytes`); without it
    only swapped tensors are counted. ``strict`` False runs a forward that saves other
    tensors than prepare saw (a mixture of experts' routing) by keeping what does not fit
    on the device (:mod:`pipeswap.swap.runtime.step_tensors`; :attr:`unmatched` counts
    them). The executor registers its module hooks (and wraps the forward of each
    recomputed layer) at construction; call :meth:`close` (or use it as a context manager)."""

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
        strict: bool = True,
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
            # Streams, events and fetches on the model's GPU, not the current one in a hook.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.account = self.device.type == "cpu" if account is None else account  # (CUDA: stats)
        check_plan_identity(plan, model, self.layer_names, profile)
        self.decisions = checked_decisions(self.gpu_plan, self.layer_names)
        self.recompute = checked_recompute(self.gpu_plan, self.layers)
        self.pool = HostPool(
            ((key, d.bytes) for key, d in self.decisions.items()),
            pin=self.device.type == "cuda",
        )
        self._ledger = DeviceLedger()
        self._recomputation = Recomputation(
            self.layers, self.recompute, self._ledger, self.account, self.gpu_plan.selective
        )
        self._transfer = SwapTransfer(self.pool, self.device, self._ledger)
        self._tensors = StepTensors(self.decisions, self._transfer, self._ledger, strict=strict)
        points = issue_points(self.decisions, self.layer_names)
        self._outs_after, self._outs_at_turn, self._prefetch_after, at_turn = points
        out = set(self._outs_at_turn)  # out and back at the turn: it never leaves the device
        self._back_at_turn = [key for key in at_turn if key in out]
        self._prefetch_at_turn = [key for key in at_turn if key not in out]
        self._previous_layer = dict(zip(self.layer_names[1:], self.layer_names))
        self._gate = PrefetchGate(self._prefetch_after, self._tensors.prefetch)
        self._ended: set[str] = set()
        self.records: dict[str, list[CapturedSavedTensor]] | None = None
        # The most bytes a step needs by the plan's memory model (resident state, saved
        # tensors, working sets), as prepare checked it against the budget.
        self.needed_bytes: int | None = None
        self._active = False
        self._prepared, self._closed = False, False
        self._step_started = time.perf_counter()
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
    def kept_bytes(self) -> dict[str, int]:
        """Per recomputed layer: what it holds from its forward to its backward (prepare)."""
        return self._recomputation.kept_bytes

    @property
    def rerun_bytes(self) -> dict[str, int]:
        """Per recomputed layer: what its re-run in the backward saves (prepare)."""
        return self._recomputation.rerun_bytes

    @property
    def unmatched(self) -> int:
        """Tensors kept and swaps skipped, over every step, because the forward saved
        other tensors than prepare saw (only without ``strict``)."""
        return self._tensors.unmatched

    @property
    def late_fetches(self) -> int:
        """Tensors unpacked before their prefetch was issued, over every step so far."""
        return self._tensors.late_total

    @property
    def swapped_bytes(self) -> int:
        """Bytes copied to the host pool over every step so far."""
        return self._tensors.swapped_total

    @property
    def budget_bytes(self) -> int:
        return self.gpu_plan.budget_bytes

    @property
    def resident_bytes(self) -> int:
        """What the device holds besides saved tensors as the profile counts it: what a
        meter read at the forward's start (profiles with ``memory``), else parameters,
        gradients and optimizer state (0 without a profile)."""
        if self.profile is None:
            return 0
        if self.profile.memory is not None:
            return measured_memory(self.profile).resident_bytes
        return self.profile.resident_bytes

    @property
    def saved_budget_bytes(self) -> int:
        """The most bytes of saved tensors the budget leaves room for at any moment."""
        return self.budget_bytes - self.resident_bytes

    def _install_hooks(self) -> None:
        for name, module in self.layers.items():
            pre = AttachedHook(self._forward_pre_hook(name))
            self._handles.append(module.register_forward_pre_hook(pre))
            watch = AttachedHook(self._backward_hook(name))  # every layer: put_back
            self._handles.append(module.register_forward_hook(watch, with_kwargs=True))
        if self._prefetch_at_turn:
            last = self.layers[self.layer_names[-1]]
            turn = AttachedHook(self._turn_hook)
            self._handles.append(last.register_forward_hook(turn, with_kwargs=True))
        self._recomputation.install()

    def close(self) -> None:
        """Remove the executor's hooks (and recomputation wrappers) from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._recomputation.remove()
        self._closed = True

    def __enter__(self) -> SwapExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(self, forward_loss: Callable[[], torch.Tensor]) -> None:
        """Name the saved tensors with one forward of ``forward_loss`` and check the plan.

        ``forward_loss`` must run the same forward and loss as the training steps (same
        shapes); call it on the bare model, not its DDP replica (pipeswap.dist.ddp).
        """
        (records, pack_calls), sizes = self._recomputation.name_step(
            self.model, forward_loss, self.layer_names
        )
        self._tensors.sizes = sizes
        if self._tensors.strict:
            check_records(self.decisions, records)
        # Without strict, a forward that saves other tensors from call to call (a branch
        # taken every other step) keeps what its names do not fit (step_tensors).
        self.records = records
        if not self.account:
            pack_calls = only_swapped(pack_calls, self.decisions)
        self._tensors.pack_calls = pack_calls
        self._prepared = True
        recomputation = self._recomputation
        self.needed_bytes = step_budget(
            self.gpu_plan,
            self.decisions,
            records,
            self.layer_names,
            profile=self.profile,
            device=self.device,
            kept_bytes=recomputation.kept_bytes,
            rerun_bytes=recomputation.rerun_bytes,
            own_rerun_bytes=recomputation.own_rerun_bytes,
        )

    # ---- hooks ----------------------------------------------------------------------
    def _forward_pre_hook(self, name: str) -> Callable[..., None]:
        # A layer's forward ends where the next one starts: whatever runs in between (an
        # activation outside any listed submodule) is named in its pack calls (the storages
        # are the next layer's, as the profiler names them: pipeswap.profiling.saved).
        previous = self._previous_layer.get(name)

        def hook(module: nn.Module, args: Any) -> None:
            if not self._active:
                return
            self._tensors.layer = name  # first: what it held for the layer before goes
            if previous is not None and previous not in self._ended:
                self._end_forward(previous)
            self._transfer.poll()
            if room is not None:
                self._transfer.make_room(room)

        # On CUDA the layer waits for swap-outs while the allocator holds more than the
        # budget leaves it (what its forward takes, as profiled): the plan's timeline waits
        # there too.
        room = None
        if self.device.type == "cuda":
            limit = self.budget_bytes - forward_need(
                self.profile, self.layer_names, self.gpu_plan, self.recompute, name
            )

            def room() -> bool:
                return torch.cuda.memory_allocated(self.device) > limit

        return hook

    def _end_forward(self, name: str) -> None:
        self._ended.add(name)
        for key in self._outs_after.get(name, ()):
            self._tensors.swap_out(key)

    def _backward_hook(self, name: str) -> Callable[..., None]:
        """A forward hook that watches for the end of the layer's backward (the gradient of
        its first input that needs one, complete once the ops the profiler counts as the
        layer's are done; its output's, when none does, which marks its start) and for the
        start of its own (its output's gradient: the next layer's prefetches wait for it).
        Tensor hooks leave the graph as it is: a module's full backward hook would regroup
        a sum of gradients (an encoder output every decoder block reads)."""
        following = {b: a for a, b in self._previous_layer.items()}.get(name)

        def done(grad: torch.Tensor, ended: bool) -> None:
            # The layer's backward is done: what its re-run saved is let go of by now.
            self._recomputation.backward_done(name)
            if ended:  # what a retained graph holds for it goes back to the host
                self._tensors.put_back(name)
            self._gate.done(name)

        def watch(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if not self._active:
                return
            wanted, ended = _needs_grad((args, kwargs)), True
            if wanted is None:  # an output's gradient: its backward starts, not ends
                wanted, ended = _needs_grad(output), False
            if wanted is not None:  # (no tensor in the hook: it would keep itself alive)
                wanted.register_hook(functools.partial(done, ended=ended))
            self._gate.watch_previous(following, _needs_grad(output))

        return watch

    def _turn_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The turn's prefetches start once the turn is over, as in the plan's timeline: when
        the last layer's output has its gradient (the head, the loss and their backward ran);
        at the forward's end they would add to the turn's working set."""
        wanted = _needs_grad(output) if self._active else None
        if wanted is not None:
            wanted.register_hook(lambda grad: self._turn_prefetch())

    def _turn_prefetch(self) -> None:
        self._transfer.poll()
        for key in self._prefetch_at_turn:
            self._tensors.prefetch(key)

    # ---- steps ----------------------------------------------------------------------

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Run the forward and loss of one step inside; the turn happens on exit."""
        why = step_refusal(prepared=self._prepared, closed=self._closed, active=self._active)
        if why is not None:
            raise PipeswapError(why)
        self._tensors.start_step(self.layer_names)
        self._ended = set()
        self._gate.start_step()
        self._ledger.start_step()
        self._recomputation.start_step()
        self._step_started = time.perf_counter()
        self._active = True
        self._recomputation.active = True
        try:
            tensors = self._tensors
            with torch.autograd.graph.saved_tensors_hooks(tensors.pack, tensors.unpack):
                yield
        finally:
            self._active = False
            self._recomputation.active = False
            self._tensors.layer = None
        self._turn()

    def _turn(self) -> None:
        for name in self.layer_names[:-1]:
            if name not in self._ended:  # a layer the forward skipped: end it now
                self._end_forward(name)
        for key in self._outs_at_turn:
            self._tensors.swap_out(key)
        self._transfer.poll()
        for key in self._back_at_turn:
            self._tensors.prefetch(key)

    def finish_step(self) -> StepStats:
        """Call after the backward: settles the copies and returns the step's numbers."""
        self._transfer.poll()
        recomputed_layers, recomputed_bytes = self._recomputation.finish_step()
        self.steps += 1
        return StepStats(
            peak_saved_bytes=self._ledger.step_peak_bytes,
            swapped_bytes=self._tensors.swapped,
            prefetched_bytes=self._tensors.prefetched,
            late_fetches=self._tensors.late,
            seconds=time.perf_counter() - self._step_started,
            recomputed_layers=recomputed_layers,
            recomputed_bytes=recomputed_bytes,
            selective_layers=len(self.gpu_plan.selective),
            shared_bytes=self._tensors.twins.shared_bytes,
        )

    def train_step(
        self, forward_loss: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, StepStats]:
        """Forward, loss and backward of one micro-batch; prepares on first use."""
        if not self._prepared:
            self.prepare(forward_loss)
        with self.forward():
            loss = forward_loss()
        loss.backward()
        return loss.detach(), self.finish_step()


def _needs_grad(tree: Any) -> torch.Tensor | None:
    """The first tensor in ``tree`` that autograd computes a gradient for."""
    leaves, _ = tree_flatten(tree)
    return next((t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad), None)
