"""UnitSwapper: swaps the saved tensors of many in-flight forwards of one module (a pipeline stage).

A pipeline stage holds the saved tensors of every unit (micro-batch) whose forward ran
and whose backward has not: stage 0 of 1F1B holds K of them. The swapper applies one
plan to every unit alike: the saved tensors of the ``swapped`` layers go to host memory
when the unit's forward ends and come back when the caller prefetches the unit (the
stage's own timeline says when: pipeswap.training.pipeline_stage_swaps); the ``recomputed``
layers run their forward again right before their backward, holding only their input.

Saved tensors are named as the profiler names them (:mod:`pipeswap.swap.runtime.capture`),
from one pass over the first unit's inputs; each unit names its pack calls by position
(:class:`~pipeswap.swap.runtime.step_tensors.StepTensors`, one per lane). A unit takes a
lane of the host pool at its forward and gives it back after its backward, so the pool
holds ``capacity`` units' swapped bytes, allocated once. On the CPU every saved tensor is
counted (:attr:`peak_saved_bytes`); the bytes are copied to the pool and read from it
as on a GPU. Swapping only moves bytes, so a unit's backward computes the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan import SwapDecision
from pipeswap.swap.plan.tensors import SavedKey
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.step_tensors import StepTensors, only_swapped
from pipeswap.swap.runtime.transfer import DeviceLedger, SwapTransfer

__all__ = ["UnitSwapper"]


class UnitSwapper:
    """Applies one per-unit plan to every forward of ``module`` that runs in :meth:`forward`.

    ``layers``: the module's layers (submodule names in forward order); ``swapped`` and
    ``recomputed``: which of them go to host memory and which recompute; ``capacity``: the
    most units in flight at once; ``prefetch_at``: per action index of the caller, the
    units to bring back once that action has run (:meth:`after_action`). Call
    :meth:`close` (or use it as a context manager) to remove its hooks.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: Sequence[str],
        *,
        swapped: Sequence[str] = (),
        recomputed: Sequence[str] = (),
        capacity: int,
        prefetch_at: Mapping[int, Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
        account: bool | None = None,
    ) -> None:
        self.layers = resolve_layers(module, layers)
        self.layer_names = list(self.layers)
        for name in (*swapped, *recomputed):
            if name not in self.layers:
                raise PipeswapError(
                    f"the stage has no layer {name!r}; its layers are {', '.join(self.layers)}"
                )
        both = set(swapped) & set(recomputed)
        if both:
            raise PipeswapError(
                f"layers {sorted(both)} are both swapped and recomputed; choose one per layer"
            )
        if capacity < 1:
            raise PipeswapError(f"capacity is {capacity} units; use 1 or more")
        self.module = module
        self.swapped = frozenset(swapped)
        self.recomputed = [n for n in self.layer_names if n in set(recomputed)]
        self.capacity = capacity
        self.prefetch_at = {i: tuple(units) for i, units in (prefetch_at or {}).items()}
        self.device = torch.device(device)
        self.account = self.device.type == "cpu" if account is None else account
        self._ledger = DeviceLedger()
        self._recomputation = Recomputation(
            self.layers, self.recomputed, self._ledger, self.account
        )
        self._transfer: SwapTransfer | None = None
        self._lanes: list[StepTensors] = []
        self._free: list[int] = []
        self._units: dict[int, int] = {}  # unit in flight -> its lane
        self._keys: list[SavedKey] = []  # what every unit swaps
        self._current: StepTensors | None = None
        self._kept: set[int] = set()  # storages the caller keeps anyway (this unit's)
        self.kept_bytes = 0  # planned swaps skipped: the caller held those storages anyway
        self._last_swap: int | None = None  # what the latest unit sent to host memory
        # Units whose swap-outs may still run: [lane, actions until they must be done].
        self._settling: list[list[int]] = []
        self.swapped_bytes = 0
        self.prefetched_units = 0
        self._handles = [
            m.register_forward_pre_hook(self._enter(name)) for name, m in self.layers.items()
        ]
        self._recomputation.install()

    # ---- what it measured ----------------------------------------------------------
    @property
    def prepared(self) -> bool:
        return self._transfer is not None

    @property
    def peak_saved_bytes(self) -> int:
        """The most bytes of saved tensors held on the device at once (every saved tensor
        with ``account``, the CPU's default; only swapped ones without)."""
        return self._ledger.peak_bytes

    @property
    def live_bytes(self) -> int:
        return self._ledger.live_bytes

    @property
    def late_fetches(self) -> int:
        """Swapped tensors the backward needed before their prefetch was issued."""
        return sum(t.late_total for t in self._lanes)

    @property
    def unit_swap_bytes(self) -> int:
        """Bytes one unit sends to host memory (the latest unit's; before any, the plan's)."""
        if self._last_swap is not None:
            return self._last_swap
        return sum(self._sizes[key] for key in self._keys) if self._lanes else 0

    def stats(self) -> dict[str, Any]:
        """What the swapper did over the run, as plain data."""
        return {
            "peak_saved_bytes": self.peak_saved_bytes,
            "swapped_bytes": self.swapped_bytes,
            "unit_swap_bytes": self.unit_swap_bytes,
            "late_fetches": self.late_fetches,
            "kept_bytes": self.kept_bytes,
            "unmatched": sum(t.unmatched for t in self._lanes),
            "swapped_layers": [n for n in self.layer_names if n in self.swapped],
            "recomputed_layers": list(self.recomputed),
            "capacity": self.capacity,
        }

    # ---- set-up ---------------------------------------------------------------------
    def prepare(self, forward_loss: Callable[[], Any]) -> None:
        """Name the saved tensors with one forward (no backward) of ``forward_loss``, which
        must run what a unit's forward runs, on a unit's shapes."""
        (records, pack_calls), sizes = self._recomputation.name_step(
            self.module, forward_loss, self.layer_names
        )
        decisions = {
            (layer, r.index): SwapDecision(layer, r.index, r.bytes, layer, None)
            for layer, recs in records.items()
            if layer in self.swapped
            for r in recs
        }
        self._keys = list(decisions)
        self._sizes = sizes
        pool = HostPool(
            (
                ((lane, *key), d.bytes)
                for lane in range(self.capacity)
                for key, d in decisions.items()
            ),
            pin=self.device.type == "cuda",
        )
        self._transfer = SwapTransfer(pool, self.device, self._ledger)
        if not self.account:
            pack_calls = only_swapped(pack_calls, decisions)
        for lane in range(self.capacity):
            tensors = StepTensors(decisions, self._transfer, self._ledger, strict=False, lane=lane)
            tensors.pack_calls, tensors.sizes = pack_calls, sizes
            self._lanes.append(tensors)
        self._free = list(range(self.capacity))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._current is not None:
                self._current.layer = name

        return hook

    def close(self) -> None:
        """Remove the swapper's hooks and recomputation wrappers from the module."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._recomputation.remove()

    def __enter__(self) -> UnitSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- units ----------------------------------------------------------------------
    @contextmanager
    def forward(self, unit: int, forward_loss: Callable[[], Any] | None = None) -> Iterator[None]:
        """Run ``unit``'s forward inside; its swapped tensors leave when it ends.

        ``forward_loss`` (a forward of the same shapes that keeps nothing) names the saved
        tensors before the first unit runs.
        """
        if not self.prepared:
            if forward_loss is None:
                raise PipeswapError("the first unit's forward needs forward_loss to name tensors")
            self.prepare(forward_loss)
        if unit in self._units:
            raise PipeswapError(f"unit {unit} is in flight already; run its backward first")
        if not self._free:
            raise PipeswapError(
                f"{self.capacity} units are in flight already, the most this stage was planned "
                f"for; run a backward before forward {unit}"
            )
        self._kept = set()
        lane = self._free.pop(0)
        tensors = self._lanes[lane]
        tensors.start_step(self.layer_names)
        self._units[unit] = lane
        self._current = tensors
        self._recomputation.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(tensors.pack, tensors.unpack):
                yield
        finally:
            self._current = None
            self._recomputation.active = False
            tensors.layer = None
        before = tensors.swapped
        for key in self._keys:
            if tensors.holds_one_of(key, self._kept):
                self.kept_bytes += self._sizes[key]
                continue
            tensors.swap_out(key)
        self._last_swap = tensors.swapped - before
        self.swapped_bytes += self._last_swap
        self._settling.append([lane, 2])  # this forward's action, then the next one

    def keep(self, tensors: Sequence[torch.Tensor]) -> None:
        """The caller holds ``tensors`` until the unit's backward anyway (a stage's input
        leaves and outputs): copying their storages to host memory would free nothing, so
        the unit's forward leaves them where they are."""
        self._kept |= {t.untyped_storage().data_ptr() for t in tensors}

    def prefetch(self, unit: int) -> None:
        """Start bringing ``unit``'s swapped tensors back (a no-op for a unit not in flight)."""
        lane = self._units.get(unit)
        if lane is None:
            return
        self.prefetched_units += 1
        for key in self._keys:
            self._lanes[lane].prefetch(key)

    def after_action(self, index: int) -> None:
        """The caller's action ``index`` has run: release finished copies, issue prefetches.

        A unit's swap-outs run during its forward's action and the next one (as the plan's
        memory model has it); once that next action is over, the stage waits for any still
        running (on CUDA; on the CPU a copy is done when issued) and lets their bytes go."""
        for item in self._settling:
            item[1] -= 1
        due = [lane for lane, left in self._settling if left <= 0]
        self._settling = [item for item in self._settling if item[1] > 0]
        if self._transfer is not None:
            for lane in due:
                self._transfer.make_room(self._lanes[lane].copying)
            self._transfer.poll()
        for unit in self.prefetch_at.get(index, ()):
            self.prefetch(unit)

    def after_backward(self, unit: int) -> None:
        """``unit``'s backward is done: what its re-runs saved is gone, its lane is free."""
        self._recomputation.finish_step()
        lane = self._units.pop(unit, None)
        if lane is not None:
            self._free.append(lane)
