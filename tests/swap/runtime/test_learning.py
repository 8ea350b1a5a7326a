"""pipeswap/swap/runtime/learning.py: a step learnt within a plan's memory, as it would run."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.swap.runtime.learning import (
    LEARNT_BY,
    learning_step,
    learnt_by,
)
from pipeswap.swap.swap_config import POLICY_NAMES


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.drop(torch.tanh(self.up(x))))


def _step(
    around: Callable[[nn.Module, dict[str, nn.Module]], AbstractContextManager[None]],
) -> tuple[list[torch.Tensor], int]:
    """One forward and backward of a 6-block model in ``around``: gradients, the meter's peak."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*(_Block() for _ in range(6)))
    x = torch.randn(1024, 64)
    layers = {str(i): block for i, block in enumerate(blocks)}
    torch.manual_seed(1)  # dropout's masks
    with DeviceMeter("cpu", holding=(blocks, x)) as meter:
        with around(blocks, layers):
            loss = blocks(x).pow(2).mean()
        loss.backward()
    return [p.grad for p in blocks.parameters() if p.grad is not None], meter.peak


def test_a_learnt_step_is_the_step_as_it_is_bit_for_bit_in_less_memory() -> None:
    plain, plain_peak = _step(lambda model, layers: learning_step("as-is", model, layers))
    learnt, peak = _step(lambda model, layers: learning_step("on-host", model, layers))
    assert all(torch.equal(a, b) for a, b in zip(plain, learnt, strict=True))
    # Six blocks' activations (1024 x 256 floats, a few per block) held as they are;
    # learnt, about one block's beyond the parameters, gradients and blocks' inputs.
    assert peak < 0.5 * plain_peak, (peak, plain_peak)


def test_a_shape_is_learnt_on_the_host_unless_the_policy_keeps_everything() -> None:
    learnt = {policy: learnt_by(policy) for policy in POLICY_NAMES}
    assert set(learnt.values()) == set(LEARNT_BY)
    assert [policy for policy, how in learnt.items() if how == "as-is"] == ["none"]


def test_the_copies_back_are_timed_apart_from_the_layers_backward() -> None:
    """Each layer's storages come back at its backward's start, noted in the timing."""
    timing = BlockTiming()
    _step(lambda model, layers: learning_step("on-host", model, layers, timing))
    assert len(timing.copies) == 6 and all(seconds >= 0 for _, seconds in timing.copies)
    starts = [when for when, _ in timing.copies]
    assert starts == sorted(starts)
