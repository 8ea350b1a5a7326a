"""What each micro-batch's loss weighs in its mini-batch's: its share of the items scored.

A loss that averages over the items it scores (cross-entropy over the tokens whose label
is not IGNORE_INDEX, a padding collator's -100) gives the mini-batch's loss as the
micro-batches' losses weighted by their share of the scored items, not as their plain
mean: rows padded to different lengths, or masked-LM batches, score different numbers of
tokens per micro-batch. A micro-batch that scores nothing (all padding) adds nothing,
where its own mean would be 0/0. Where every micro-batch scores as many items, the
weights are ``1/M`` exactly and the arithmetic is the plain mean's, bit for bit.

How a loss counts its items is its own: pipeswap's cross-entropy counts the targets that
are not IGNORE_INDEX; a Hugging Face causal LM's own loss shifts its labels first
(pipeswap.models.scored). A loss whose rule is unknown (a user's ``loss_fn``) weighs every
micro-batch alike, and a warning says so when the labels hold IGNORE_INDEX unevenly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeswap.errors import PipeswapError
from pipeswap.models.base import IGNORE_INDEX

__all__ = ["ItemCount", "LossShares", "Share", "shares_from", "shares_of", "weighted_loss"]

_NOTHING_SCORED = (
    "every label of this batch is IGNORE_INDEX (-100): its loss scores nothing (0/0); "
    "leave such batches out of the loop"
)
# Counts the items a loss scores in one micro-batch's target.
ItemCount = Callable[[torch.Tensor], int]


@dataclass(frozen=True)
class Share:
    """A micro-batch's ``items`` of its mini-batch's ``total``, among ``count`` micro-batches."""

    items: int
    total: int
    count: int

    @property
    def even(self) -> bool:
        return self.items * self.count == self.total

    def scaled(self, loss: torch.Tensor, output: Any = None) -> torch.Tensor:
        """The micro-batch's part of the mini-batch loss, what its backward starts from."""
        if self.even:
            return loss / self.count
        if self.items == 0:
            # Its own mean is 0/0: a zero that still reaches every weight the forward used,
            # so the backward runs (the schedule's transfers, DDP's all-reduce) and adds
            # nothing: through the output where given, else through the NaN made 0 (whose
            # gradient torch takes as 0 where the value was not finite).
            if output is None:
                return torch.nan_to_num(loss) * 0.0
            leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            zero = torch.zeros((), device=loss.device)
            return sum((t.float().sum() * 0.0 for t in leaves if t.requires_grad), zero)
        return loss / (self.total / self.items)


def shares_of(targets: Sequence[torch.Tensor], count: ItemCount | None) -> list[Share] | None:
    """Each micro-batch's share; None where they weigh alike (no rule, or even counts)."""
    if count is None:
        _warn_if_uneven(targets)
        return None
    items = [count(t) for t in targets]
    return shares_from(items, sum(items))


def shares_from(items: Sequence[int], total: int, world: int = 1) -> list[Share] | None:
    """The shares of one rank's micro-batches scoring ``items`` of the ``total`` every rank
    scores; data parallelism averages the ranks' gradients, so each weighs ``world`` times
    its share (None where every micro-batch of every rank scores as many)."""
    if total == 0:
        raise PipeswapError(_NOTHING_SCORED)
    shares = [Share(n * world, total, len(items)) for n in items]
    return None if all(s.even for s in shares) else shares


def weighted_loss(losses: Sequence[float], shares: Sequence[Share] | None) -> float:
    """The mini-batch's loss from its micro-batches' (their mean where they weigh alike)."""
    if shares is None:
        return sum(losses) / len(losses)
    return sum(loss * s.items / s.total for loss, s in zip(losses, shares) if s.items)


class LossShares:
    """The shares of the micro-batches of the mini-batch a pipeline is fed, by unit.

    ``targets(step)`` is the whole mini-batch's target; it is cut into ``micro_batches``
    as the pipeline cuts it (pipeswap.pipeline.feed)."""

    def __init__(
        self,
        count: ItemCount | None,
        targets: Callable[[int], torch.Tensor],
        micro_batches: int,
    ) -> None:
        self.count, self.targets, self.micro_batches = count, targets, micro_batches
        self._step: tuple[int, list[Share] | None] | None = None

    def of_step(self, step: int) -> list[Share] | None:
        if self._step is None or self._step[0] != step:
            target = self.targets(step)
            self._step = (step, shares_of(target.chunk(self.micro_batches), self.count))
        return self._step[1]

    def of_unit(self, unit: int) -> Share | None:
        step, micro = divmod(unit, self.micro_batches)
        shares = self.of_step(step)
        return None if shares is None else shares[micro]


def _warn_if_uneven(targets: Sequence[torch.Tensor]) -> None:
    if not targets or targets[0].is_floating_point():
        return
    ignored = [int((t == IGNORE_INDEX).sum()) for t in targets]
    if len(set(ignored)) > 1:
        warnings.warn(
            "the labels hold IGNORE_INDEX (-100) unevenly across micro-batches, and the "
            "pipeline cannot tell how the loss counts what it scores (your loss_fn, or a "
            "model's own loss of a kind pipeswap does not know): each micro-batch's loss "
            "weighs alike, which differs from one loss over the whole batch; pass target= "
            "without loss_fn (cross-entropy over the scored tokens), or micro_batches=1",
            stacklevel=3,
        )
