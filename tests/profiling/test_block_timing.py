"""pipeswap/profiling/block_timing.py: block times of one step, by hooks that change nothing."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.profiling.block_timing import BlockTiming, time_blocks


def test_a_blocks_backward_runs_to_the_start_of_the_previous_ones() -> None:
    timing = BlockTiming(backward_started={"c": 1.0, "b": 1.5, "a": 2.5}, ended=4.0)
    timing.forward_s = {"a": 0.1, "b": 0.1, "c": 0.1}
    assert timing.complete(["a", "b", "c"]) and not timing.complete(["a", "b", "c", "d"])
    assert timing.backward_s(["a", "b", "c"]) == {"a": 1.5, "b": 1.0, "c": 0.5}


def test_every_block_is_timed_and_the_gradients_do_not_move() -> None:
    def run(timed: bool) -> tuple[list[torch.Tensor], BlockTiming]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        timing = BlockTiming()
        layers = {"0": model[0], "1": model[1], "2": model[2]}
        handles = time_blocks(layers, timing, torch.device("cpu")) if timed else []
        x = torch.randn(3, 4)
        model(x).square().sum().backward()
        for handle in handles:
            handle.remove()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None], timing

    plain, _ = run(False)
    grads, timing = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True))
    assert timing.complete(["0", "1", "2"])
    assert all(seconds >= 0 for seconds in timing.backward_s(["0", "1", "2"]).values())
    assert timing.output_bytes == {"0": 48, "1": 48, "2": 48}
