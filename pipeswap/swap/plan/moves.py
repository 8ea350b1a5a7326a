"""The moves of auto's local search: shift, add, drop or trade swaps, toggle recomputation."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pipeswap.swap.plan.case import Case, all_tensors
from pipeswap.swap.plan.tensors import SMALLEST_TENSOR_BYTES, SavedTensorAt, SwapDecisionAt
from pipeswap.swap.plan.workload import Workload

__all__ = ["OFFSET_FACTORS", "Moves", "Offsets", "Recomputes", "State", "Swaps", "ordered"]

# A plan in search form: per member its swaps, its start offset and its recomputed layers.
Swaps = dict[str, tuple[SwapDecisionAt, ...]]
Offsets = dict[str, float]
Recomputes = dict[str, frozenset[int]]
State = tuple[Swaps, Offsets, Recomputes]

OFFSET_FACTORS = (0.8, 0.9, 0.95, 0.98, 1.02, 1.05, 1.1, 1.25)


def ordered(swaps: Iterable[SwapDecisionAt]) -> tuple[SwapDecisionAt, ...]:
    return tuple(sorted(swaps, key=lambda s: (s.layer, s.index)))


class Moves:
    """Random moves from a plan, each keeping every GPU within its budget.

    A swap-out point up to two layers later or earlier; a prefetch point up to two
    backwards earlier or later; a tensor dropped, added (prefetched just in time or at
    the turn), or replaced by a nearby unswapped tensor, which may also take the old
    tensor's turn on the copy engine while the old one goes later; one tensor each
    exchanged between two GPUs of the channel; a start offset scaled, nudged or set; a
    layer recomputed (its swaps dropped) or no longer recomputed. A recomputed layer's
    tensors are never swapped.
    """

    def __init__(self, case: Case, members: Sequence[str], rng: random.Random) -> None:
        self.workload = case.workload
        self.budget = case.budget_bytes
        self.members = list(members)
        self.rng = rng
        self.n = case.workload.num_layers
        self.forward_s = sum(case.workload.forward_s)
        # Every tensor a plan may swap (a recomputed layer's too: views may differ).
        self.tensors = [
            t
            for t in all_tensors(case.workload.recomputing(()))
            if t.bytes >= SMALLEST_TENSOR_BYTES
        ]
        # Layers whose recomputation frees memory that matters.
        self.layers = [
            i for i, freed in enumerate(case.workload.freed_bytes) if freed >= SMALLEST_TENSOR_BYTES
        ]
        self.recompute: Recomputes = {}  # the plan being moved from (set by ``sample``)
        # Offset moves change offsets, recompute moves layers, the others swaps: one
        # tuple, so each is drawn alike.
        self.kinds: tuple[Callable[[str, Any], Any], ...] = (
            self._shift_out,
            self._shift_prefetch,
            self._drop,
            self._add,
            self._replace,
            self._replace,
            self._exchange,
            self._offset,
            self._recompute,
        )

    def view(self, gpu: str) -> Workload:
        return self.workload.recomputing(self.recompute.get(gpu, ()))

    def sample(self, swaps: Swaps, offsets: Offsets, recompute: Recomputes) -> State | None:
        """One random move, or None when the drawn move is impossible or does not fit."""
        self.recompute = recompute
        gpu = self.rng.choice(self.members)
        kind = self.rng.choice(self.kinds)
        if kind == self._offset:
            changed_offsets = self._offset(gpu, offsets)
            return None if changed_offsets is None else (swaps, changed_offsets, recompute)
        if kind == self._recompute:
            toggled = self._recompute(gpu, swaps)
            if toggled is None:
                return None
            layers, plan = toggled
            view = self.workload.recomputing(layers)
            if not view.fits(plan, self.budget):
                return None
            return {**swaps, gpu: plan}, offsets, {**recompute, gpu: layers}
        moved: dict[str, list[SwapDecisionAt]] | None = kind(gpu, swaps)
        if not moved:
            return None
        changed = {g: ordered(plan) for g, plan in moved.items()}
        if any(
            plan == swaps[g] or not self.view(g).fits(plan, self.budget)
            for g, plan in changed.items()
        ):
            return None
        return {**swaps, **changed}, offsets, recompute

    def _recompute(
        self, gpu: str, swaps: Swaps
    ) -> tuple[frozenset[int], tuple[SwapDecisionAt, ...]] | None:
        if not self.layers:
            return None
        layer = self.rng.choice(self.layers)
        current = self.recompute.get(gpu, frozenset())
        if layer in current:
            return current - {layer}, swaps[gpu]
        return current | {layer}, tuple(s for s in swaps[gpu] if s.layer != layer)

    def _pick(self, swaps: Swaps, gpu: str) -> tuple[SwapDecisionAt, list[SwapDecisionAt]] | None:
        plan = list(swaps[gpu])
        if not plan:
            return None
        k = self.rng.randrange(len(plan))
        return plan[k], plan[:k] + plan[k + 1 :]

    def _shift_out(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        picked = self._pick(swaps, gpu)
        if picked is None:
            return None
        s, rest = picked
        out = s.out + self.rng.choice((-2, -1, 1, 2))
        if not s.layer <= out < self.n:
            return None
        return {gpu: [*rest, SwapDecisionAt(s.layer, s.index, s.bytes, out, s.prefetch)]}

    def _shift_prefetch(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        picked = self._pick(swaps, gpu)
        if picked is None:
            return None
        s, rest = picked
        point = s.prefetch + self.rng.choice((-2, -1, 1, 2))
        if not s.layer < point <= self.n:
            return None
        return {gpu: [*rest, SwapDecisionAt(s.layer, s.index, s.bytes, s.out, point)]}

    def _drop(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        picked = self._pick(swaps, gpu)
        return None if picked is None else {gpu: picked[1]}

    def _unswapped(self, swaps: Swaps, gpu: str, near: int | None = None) -> list[SavedTensorAt]:
        taken = {(s.layer, s.index) for s in swaps[gpu]}
        recomputed = self.view(gpu).recompute
        return [
            t
            for t in self.tensors
            if (t.layer, t.index) not in taken
            and t.layer not in recomputed
            and (near is None or abs(t.layer - near) <= 2)
        ]

    def _add(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        free = self._unswapped(swaps, gpu)
        if not free:
            return None
        layer, index, nbytes = self.rng.choice(free)
        point = self.rng.choice((layer + 1, self.n))
        return {gpu: [*swaps[gpu], SwapDecisionAt(layer, index, nbytes, layer, point)]}

    def _replace(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        picked = self._pick(swaps, gpu)
        if picked is None:
            return None
        s, rest = picked
        free = self._unswapped(swaps, gpu, near=s.layer)
        if not free:
            return None
        layer, index, nbytes = self.rng.choice(free)
        point = max(layer + 1, s.prefetch)
        if layer <= s.out and s.out + 1 < self.n and self.rng.random() < 0.5:
            # The new tensor takes the old one's turn on the copy engine; the old one
            # goes one or two layers later.
            later = min(self.n - 1, s.out + self.rng.choice((1, 2)))
            return {
                gpu: [
                    *rest,
                    SwapDecisionAt(layer, index, nbytes, s.out, point),
                    SwapDecisionAt(s.layer, s.index, s.bytes, later, s.prefetch),
                ]
            }
        return {gpu: [*rest, SwapDecisionAt(layer, index, nbytes, layer, point)]}

    def _exchange(self, gpu: str, swaps: Swaps) -> dict[str, list[SwapDecisionAt]] | None:
        others = [g for g in self.members if g != gpu]
        if not others:
            return None
        other = self.rng.choice(others)
        mine = {(s.layer, s.index) for s in swaps[gpu]}
        theirs = {(s.layer, s.index) for s in swaps[other]}
        give = [s for s in swaps[gpu] if (s.layer, s.index) not in theirs]
        if not give:
            return None
        s = self.rng.choice(give)
        take = [
            t
            for t in swaps[other]
            if (t.layer, t.index) not in mine
            and abs(t.layer - s.layer) <= 2
            and t.layer not in self.view(gpu).recompute
        ]
        if s.layer in self.view(other).recompute:
            return None
        if not take:
            return None
        t = self.rng.choice(take)
        return {
            gpu: [*(x for x in swaps[gpu] if x is not s), t],
            other: [*(x for x in swaps[other] if x is not t), s],
        }

    def _offset(self, gpu: str, offsets: Offsets) -> Offsets | None:
        if offsets.get(gpu):
            if self.rng.random() < 0.5:
                value = offsets[gpu] * self.rng.choice(OFFSET_FACTORS)
            else:
                value = (
                    offsets[gpu] + self.rng.choice((-0.02, -0.005, 0.005, 0.02)) * self.forward_s
                )
        else:
            value = self.rng.choice((0.05, 0.1, 0.25, 0.5, 1.0)) * self.forward_s
        return {**offsets, gpu: max(0.0, value)}
