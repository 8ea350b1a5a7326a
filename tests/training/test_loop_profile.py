"""pipeswap/training/loop_profile.py: a user's loop as the planner sees it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.training.loop_profile import loop_profile


def test_parameters_outside_the_layers_count_with_the_first_and_the_batch_is_the_first_tensor() -> (
    None
):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    layers = {"0": model[0], "1": model[1]}  # the last Linear is outside them
    timing = BlockTiming(
        forward_s={"0": 0.1, "1": 0.2},
        output_bytes={"0": 64, "1": 64},
        backward_started={"0": 1.0, "1": 0.7},
        ended=1.5,
    )
    records = {
        "0": [CapturedSavedTensor("0", 0, 64, (4, 4), "float32")],
        "1": [CapturedSavedTensor("1", 0, 64, (4, 4), "float32")],
    }
    profile = loop_profile(
        model,
        layers,
        records,
        timing,
        ((torch.zeros(5, 4),), {}),
        optimizer="sgd",
        memory=None,
        kept={"0": 16},
        rerun={"0": 48},
    )
    per_linear = (16 + 4) * 4
    assert [layer.param_bytes for layer in profile.layers] == [per_linear + 40, per_linear]
    assert profile.batch == 5 and profile.optimizer_state_bytes == profile.param_bytes
    assert [layer.backward_s for layer in profile.layers] == pytest.approx([0.5, 0.3])
    assert (profile.layers[0].kept_bytes, profile.layers[1].kept_bytes) == (16, None)
