"""What Offload.stats() says of the plan a step ran.

Covers: pipeswap/training/loop_stats.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.training.loop_stats import plan_stats
from pipeswap.training.offload import offload

pytestmark = pytest.mark.usefixtures("one_thread")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def test_the_plan_part_states_its_predictions_beside_the_meter_s_reading() -> None:
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy="save-on-cpu")
    for _ in range(3):
        with off:
            loss = model(torch.randn(16, 128, 64))
        loss.backward()
    (planned,) = off.shapes.plans.values()
    said = plan_stats(planned, 12345)
    result = planned.result
    assert said["policy"] == result.policy == "save-on-cpu"
    assert said["measured_peak_bytes"] == 12345
    assert said["predicted_step_s"] == result.iteration_s
    assert said["predicted_stall_s"] == max(0.0, result.iteration_s - result.compute_s)
    assert said["planned_for_bytes"] == result.budget_bytes == off.stats()["budget_bytes"]
    assert 0 < said["smallest_budget_bytes"] <= said["no_swap_peak_bytes"]
    # stats() reports the same plan part, with the meter's own reading.
    stats = off.stats()
    for key in ("policy", "predicted_peak_bytes", "no_swap_peak_bytes", "replans"):
        assert stats[key] == said[key], key
    off.close()


def test_before_any_plan_stats_has_the_same_keys_and_the_policy_asked_for() -> None:
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy="save-on-cpu")
    with off:
        loss = model(torch.randn(16, 128, 64))
    loss.backward()
    learnt = off.stats()  # the first step learns: no plan has run yet
    assert learnt["policy"] == "save-on-cpu"
    assert learnt["predicted_peak_bytes"] is None and learnt["replans"] is None
    for _ in range(2):
        with off:
            loss = model(torch.randn(16, 128, 64))
        loss.backward()
    assert set(off.stats()) == set(learnt)
    off.close()
