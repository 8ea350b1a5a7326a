"""The stages meet at a step's end: clipping by the global norm, held-out scores every N steps.

Covers: pipeswap/pipeline/step_end.py, pipeswap/pipeline/held_out.py,
pipeswap/pipeline/emulator.py (meetings), pipeswap/pipeline/shared.py (tied norms).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from runtime_check import assert_runtime_matches_emulator
from support import pipeline_run
from test_tied import NODROP, plain_losses

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.step_end import clip_scale, meeting_points_hold
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.kinds import SCHEDULE_NAMES, SCHEDULES
from pipeswap.schedule.timetable import build_schedule


def test_clip_scale_is_torchs_over_every_stages_share() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    copies = [g.clone() for g in grads]
    parts = [float(grads[0].double().norm() ** 2), float(grads[1].double().norm() ** 2)]
    parts.append(float(grads[2].double().norm() ** 2))
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in copies]
    for p, g in zip(params, copies, strict=True):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=False)
    scale = clip_scale(parts, 0.5)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-6, atol=0)
    assert clip_scale(parts, 1e6) == 1.0  # a bound above the norm leaves gradients alone


def test_every_schedule_lets_the_stages_meet_at_each_update() -> None:
    for name in SCHEDULE_NAMES:
        for stages in (2, 3, 4):
            m = SCHEDULES[name].default_micro_batches(stages)
            assert meeting_points_hold(build_schedule(name, stages, 5, m)), (name, stages)
    # A stage that sends after its UPDATE would make its neighbour wait for it there.
    schedule = build_schedule("1f1b", 2, 3, 2)
    rank1 = list(schedule.actions[1])
    at = next(i for i, a in enumerate(rank1) if a.kind is ActionKind.UPDATE)
    rank1[at - 1], rank1[at] = rank1[at], rank1[at - 1]  # UPDATE(0) before SEND_B(1)
    late = replace(schedule, actions=(schedule.actions[0], tuple(rank1)))
    assert not meeting_points_hold(late)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_clipped_synchronous_pipeline_is_clipped_plain_training(schedule: str) -> None:
    """Tied weights (embedding and head on different stages) count once in the norm."""
    config = replace_fields(NODROP, schedule=schedule, micro_batches=2, lr=0.5, clip_grad_norm=0.2)
    clipped = Emulator(config, record=False).run()
    want, _ = plain_losses(config)
    for got, ref in zip(clipped.losses, want, strict=True):
        assert abs(got - ref) <= 1e-5 * abs(ref)
    free = Emulator(replace_fields(config, clip_grad_norm=None), record=False).run()
    assert free.losses[1:] != clipped.losses[1:]  # the bound was below the norm


def test_scores_every_n_steps_change_nothing_and_equal_a_shorter_runs_end() -> None:
    config = pipeline_run(
        "resnet-micro", (3, 3), batch=8, steps=4, schedule="1f1b", micro_batches=2, lr=0.05
    )
    scored = Emulator(replace_fields(config, eval_every=2), record=False).run()
    plain = Emulator(config, record=False).run()
    shorter = Emulator(replace_fields(config, steps=2), record=False).run()
    assert (scored.losses, scored.params_sha256) == (plain.losses, plain.params_sha256)
    assert scored.eval == plain.eval
    assert scored.evals == ({"step": 2, **shorter.eval},)
    assert 0.0 <= scored.evals[0]["accuracy"] <= 1.0


def test_scoring_needs_held_out_batches() -> None:
    with pytest.raises(ConfigError, match="eval_every scores the held-out batches"):
        replace_fields(NODROP, eval_every=2, eval_batches=0)


@pytest.mark.dist
def test_runtime_meets_as_the_emulator_bit_for_bit() -> None:
    configs: list[Any] = [
        replace_fields(NODROP, schedule="1f1b", micro_batches=2, clip_grad_norm=0.2, lr=0.5),
        replace_fields(NODROP, schedule="1f1b", micro_batches=2, eval_every=2),
        replace_fields(
            NODROP,
            schedule="async-1f1b",
            weights="spectrain",
            clip_grad_norm=0.2,
            eval_every=2,
            lr=0.5,
        ),
    ]
    reports = assert_runtime_matches_emulator(configs, 2)
    assert [len(r["evals"]) for r in reports] == [0, 2, 2]
