"""Weights tied across stages: a copy per stage, equal copies, plain training when synchronous.

Covers: pipeswap/pipeline/shared.py, pipeswap/pipeline/weights.py (tied copies).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import pipeline_run

from pipeswap.config_fields import replace_fields
from pipeswap.dist.digest import params_sha256
from pipeswap.dist.group import single_threaded
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.job import BatchSource, build_full_model
from pipeswap.pipeline.shared import find_shared, plan_sharing, stage_module
from pipeswap.pipeline.stage import StageRunner
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.kinds import SCHEDULE_NAMES, SCHEDULES
from pipeswap.schedule.modes import WEIGHT_MODES
from pipeswap.schedule.timetable import build_schedule
from pipeswap.train_config import TrainConfig

TIED = pipeline_run(
    "pipeline_toys:toy_tied_lm", (2, 3), batch=8, seq_len=16, steps=5, lr=0.05, eval_batches=1
)
NODROP = replace_fields(TIED, model="pipeline_toys:toy_tied_lm_nodrop")
OPTIMIZER = {"stale": "sgd", "stash": "sgd", "spectrain": "sgd", "predict-adam": "adam"}


def plain_losses(config: TrainConfig) -> tuple[list[float], str]:
    """One process, the whole tied model, the same batches and optimizer: (losses, digest);
    with ``clip_grad_norm``, torch's clipping before each step."""
    with single_threaded():
        model = build_full_model(config)
        optimizer = config.optim.build(list(model.parameters()))
        data = BatchSource(config, model)
        losses = []
        for step in range(config.steps):
            total = 0.0
            for micro in range(config.require_pipeline().micro_batch_count):
                x, y = data.micro(step, micro)
                loss = model.loss(model(x), y)
                (loss / config.require_pipeline().micro_batch_count).backward()
                total += loss.item()
            losses.append(total / config.require_pipeline().micro_batch_count)
            if config.optim.clip_grad_norm is not None:
                params = list(model.parameters())
                torch.nn.utils.clip_grad_norm_(params, config.optim.clip_grad_norm, foreach=False)
            optimizer.step()
            optimizer.zero_grad()
    return losses, params_sha256(model)


def test_tied_parameters_are_found_by_name_and_copied_per_stage() -> None:
    model = build_full_model(TIED)
    shared = find_shared(model, TIED.require_pipeline().stage_balance)
    assert [(s.name, s.holders) for s in shared] == [("embed.tokens.weight", (0, 1))]
    assert find_shared(model, (5,)) == []  # one stage holds both ends: nothing to share
    first, copies0 = stage_module(model, 0, 2, shared)
    last, copies1 = stage_module(model, 2, 5, shared)
    tied = model.embed.tokens.weight
    a, b = copies0["embed.tokens.weight"], copies1["embed.tokens.weight"]
    assert a is not tied and b is not tied and a is not b
    assert torch.equal(a, tied) and torch.equal(b, tied)
    assert last.head.out.weight is b and first.embed.tokens.weight is a
    # Everything else is the model's own tensors (no copy).
    assert first.block0.linear.weight is model.block0.linear.weight
    assert last.head.ln.weight is model.head.ln.weight


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sync_copies_apply_update_t_before_any_pass_of_t_plus_1(schedule: str) -> None:
    sched = build_schedule(schedule, 4, 5, 2)
    plan = plan_sharing(sched, (0, 3))
    for h in (0, 3):
        actions = sched.actions[h]
        for t in range(4):
            first_next = min(
                i for i, a in enumerate(actions) if a.kind == ActionKind.F and a.unit // 2 == t + 1
            )
            assert plan.apply_at[h][t] == first_next
        assert plan.apply_at[h][4] == len(actions)  # the last update: after the last action


def test_async_last_stage_applies_one_update_late() -> None:
    """async-1f1b, 2 stages: both copies apply update t right before their F(t+2); stage 0
    runs it right after its own UPDATE(t), the last stage after its UPDATE(t+1)."""
    sched = build_schedule("async-1f1b", 2, 6)
    plan = plan_sharing(sched, (0, 1))
    for h, lag in ((0, 0), (1, 1)):
        actions = sched.actions[h]
        for t in range(4):
            at = plan.apply_at[h][t]
            assert (actions[at].kind, actions[at].unit) == (ActionKind.F, t + 2)
            updates_before = [a.unit for a in actions[:at] if a.kind == ActionKind.UPDATE]
            assert updates_before[-1] == t + lag


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sync_tied_pipeline_is_plain_training(schedule: str, optimizer: str) -> None:
    config = replace_fields(
        NODROP,
        schedule=schedule,
        micro_batches=2,
        optimizer=optimizer,
        lr=0.05 if optimizer == "sgd" else 3e-3,
    )
    result = Emulator(config, record=False).run()
    reference, _ = plain_losses(config)
    for got, want in zip(result.losses, reference, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert reference[-1] < reference[0]  # it trained


def test_one_micro_batch_sync_tied_pipeline_is_plain_training_bitwise() -> None:
    config = replace_fields(NODROP, schedule="1f1b")
    result = Emulator(config, record=False).run()
    losses, digest = plain_losses(config)
    assert list(result.losses) == losses and result.params_sha256 == digest


def _modes() -> list[tuple[str, str, str, int]]:
    out = []
    for schedule in SCHEDULE_NAMES:
        for weights, mode in WEIGHT_MODES.items():
            if not (mode.live or SCHEDULES[schedule].asynchronous):
                continue  # refused: nothing is stale on a synchronous schedule
            optimizer = OPTIMIZER.get(weights, "adamw")
            out.append((schedule, weights, optimizer, 1 if schedule == "async-1f1b" else 2))
    return out


def test_every_schedule_and_mode_keeps_tied_copies_bitwise_equal() -> None:
    digests = set()
    for schedule, weights, optimizer, micro in _modes():
        config = replace_fields(
            TIED,
            schedule=schedule,
            weights=weights,
            optimizer=optimizer,
            micro_batches=micro,
            lr=0.05 if optimizer == "sgd" else 3e-3,
            steps=4,
        )
        emulator = Emulator(config, record=False)
        result = emulator.run()
        first, last = (ex.weights.shared["embed.tokens.weight"] for ex in emulator.executors)
        label = f"{schedule}/{weights}"
        assert torch.equal(first, last), label
        assert all(
            ex.weights.shared_applied == {"embed.tokens.weight": 4} for ex in emulator.executors
        ), label
        assert all(torch.isfinite(torch.tensor(result.losses))), label
        digests.add(result.params_sha256)
    # Not vacuous: the modes train differently (sync schedules share their updates).
    assert len(digests) >= len(WEIGHT_MODES) + 2


def test_spectrain_predicts_the_same_weights_on_every_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """async-1f1b: stage 0's forward of t (s = 1) and the last stage's (s = 0, but its copy
    one update behind) both predict the tied weight at version t, bit for bit."""
    config = replace_fields(TIED, schedule="async-1f1b", weights="spectrain", steps=6)
    seen: dict[tuple[int, int], torch.Tensor] = {}
    forward = StageRunner.forward

    def recording(
        runner: StageRunner, unit: int, inputs: Any, target: torch.Tensor | None = None
    ) -> Any:
        module: Any = runner.module
        weight = module.embed.tokens.weight if runner.is_first else module.head.out.weight
        seen[(runner.index, unit)] = weight.detach().clone()
        return forward(runner, unit, inputs, target)

    monkeypatch.setattr(StageRunner, "forward", recording)
    Emulator(config, record=False).run()
    assert all(torch.equal(seen[(0, u)], seen[(1, u)]) for u in range(6))
    assert not torch.equal(seen[(0, 0)], seen[(0, 5)])


def test_a_pipeline_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    config = replace_fields(TIED, schedule="async-1f1b", weights="spectrain")
    first = Emulator(config, record=False).run()
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(99)  # the caller's seed does not reach the stages' streams
    assert Emulator(config, record=False).run().losses == first.losses
