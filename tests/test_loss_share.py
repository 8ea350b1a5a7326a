"""pipeswap/loss_share.py: a micro-batch's loss weighs its share of the scored items."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from pipeswap.errors import PipeswapError
from pipeswap.loss_share import LossShares, Share, shares_from, shares_of, weighted_loss
from pipeswap.models.scored import scored_targets


def _targets(rows: list[int], width: int = 6) -> torch.Tensor:
    """One row per entry, scoring that many tokens, the rest IGNORE_INDEX."""
    target = torch.full((len(rows), width), -100)
    for i, n in enumerate(rows):
        target[i, :n] = torch.arange(n) % 5
    return target


def test_the_weighted_micro_batch_losses_are_the_whole_batch_s_token_mean() -> None:
    torch.manual_seed(0)
    target = _targets([1, 6, 0, 3, 2, 6, 5, 4])
    logits = torch.randn(8, 6, 5)
    whole = F.cross_entropy(logits.reshape(-1, 5), target.reshape(-1), ignore_index=-100)
    parts = zip(logits.chunk(4), target.chunk(4))
    losses = [F.cross_entropy(x.reshape(-1, 5), y.reshape(-1)).item() for x, y in parts]
    shares = shares_of(target.chunk(4), scored_targets)
    assert shares is not None and [s.items for s in shares] == [7, 3, 8, 9]
    assert weighted_loss(losses, shares) == pytest.approx(whole.item(), rel=1e-6)
    assert weighted_loss(losses, shares) != pytest.approx(sum(losses) / 4, rel=1e-3)


def test_even_counts_are_the_plain_mean_bit_for_bit() -> None:
    assert shares_of(_targets([3, 3, 3, 3, 3, 3]).chunk(3), scored_targets) is None
    loss = torch.tensor(2.7182817)
    assert torch.equal(Share(2, 6, 3).scaled(loss, None), loss / 3)
    losses = [0.1, 0.7, 0.3]
    assert weighted_loss(losses, None) == sum(losses) / 3


def test_a_micro_batch_that_scores_nothing_adds_a_zero_that_still_reaches_the_weights() -> None:
    weight = torch.ones(3, requires_grad=True)
    output = weight * 2.0
    nan = output.sum() * float("nan")
    zero = Share(0, 5, 2).scaled(nan, output)
    zero.backward()
    assert (
        zero.item() == 0.0 and weight.grad is not None and torch.equal(weight.grad, torch.zeros(3))
    )
    assert weighted_loss([float("nan"), 1.5], [Share(0, 5, 2), Share(5, 5, 2)]) == 1.5


def test_a_batch_that_scores_nothing_is_refused() -> None:
    with pytest.raises(PipeswapError, match="every label of this batch is IGNORE_INDEX"):
        shares_of(_targets([0, 0]).chunk(2), scored_targets)


def test_an_unknown_loss_weighs_alike_and_says_so_where_padding_is_uneven() -> None:
    with pytest.warns(UserWarning, match="cannot tell how the loss counts"):
        assert shares_of(_targets([1, 6]).chunk(2), None) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shares_of(_targets([4, 4]).chunk(2), None) is None


def test_shares_follow_the_fed_step_once_per_step() -> None:
    fed = {0: _targets([1, 2, 3, 4]), 1: _targets([2, 2, 2, 2])}
    read: list[int] = []

    def targets(step: int) -> torch.Tensor:
        read.append(step)
        return fed[step]

    shares = LossShares(scored_targets, targets, micro_batches=2)
    assert shares.of_unit(0) == Share(3, 10, 2) and shares.of_unit(1) == Share(7, 10, 2)
    assert shares.of_unit(2) is None and shares.of_unit(3) is None
    assert read == [0, 1]


def test_a_rank_s_shares_count_every_rank_s_items() -> None:
    """Data parallelism averages the ranks' gradients: a micro-batch of one of 2 ranks
    scoring 3 of the 10 items every rank scores weighs 2 * 3 / 10 of its mean gradient."""
    shares = shares_from([3, 1], total=10, world=2)
    assert shares == [Share(6, 10, 2), Share(2, 10, 2)]
    loss = torch.tensor(1.0)
    assert shares[0].scaled(loss).item() == pytest.approx(0.6)
    assert shares_from([2, 2], total=8, world=2) is None  # even: the plain 1/accumulate
    nan = torch.tensor(float("nan"), requires_grad=True)
    assert Share(0, 10, 2).scaled(nan * 1.0).item() == 0.0
