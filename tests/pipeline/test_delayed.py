"""Delayed-gradient training reproduces the sync and the stash pipelines bit for bit.

The bitwise comparisons train gpt2-micro with its head untied (``UNTIED``): a pipeline adds
a tied weight's gradients per holding stage, plain autograd per micro-batch, so tied runs
agree to rounding only (tests/pipeline/test_tied.py); one micro-batch is bitwise either way.

Covers: pipeswap/pipeline/delayed.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import pipeline_run

from pipeswap.config_fields import replace_fields
from pipeswap.dist.group import single_threaded
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.delayed import schedule_delays, train_with_delays
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.job import BatchSource, build_full_model
from pipeswap.train_config import TrainConfig

LR = {"sgd": 0.05, "adam": 1e-3}
GPT = pipeline_run("gpt2-micro", (2, 2), batch=4, steps=8, seq_len=16, eval_batches=2)
UNTIED = replace_fields(GPT, model="pipeline_toys:gpt2_micro_untied")
IMAGE = pipeline_run(
    "resnet-micro", (2, 2, 1, 1), optimizer="adam", lr=3e-3, batch=8, steps=6, image_size=32
)


def _gpt(balance: tuple[int, ...], optimizer: str, **changes: Any) -> TrainConfig:
    return replace_fields(UNTIED, balance=balance, optimizer=optimizer, lr=LR[optimizer], **changes)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("balance", [(2, 2), (1, 1, 1, 1)], ids=["2-stages", "4-stages"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_no_delay_is_the_sync_pipeline_bitwise(
    optimizer: str, balance: tuple[int, ...], micro_batches: int
) -> None:
    config = _gpt(balance, optimizer, schedule="1f1b", micro_batches=micro_batches)
    assert schedule_delays(config) == (0, 0, 0, 0)
    pipeline = Emulator(config, record=False).run()
    delayed = train_with_delays(config, [0, 0, 0, 0])
    assert delayed.losses == pipeline.losses
    assert delayed.eval == pipeline.eval
    assert len(delayed.losses) == config.steps


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("balance", [(2, 2), (1, 1, 1, 1)], ids=["2-stages", "4-stages"])
def test_stash_delays_are_the_stash_pipeline_bitwise(
    optimizer: str, balance: tuple[int, ...]
) -> None:
    config = _gpt(balance, optimizer, schedule="async-1f1b", weights="stash")
    n = len(balance)
    # Stage k takes its gradient N-k-1 updates late (the walked forward distance).
    expected = tuple(n - k - 1 for k, layers in enumerate(balance) for _ in range(layers))
    assert schedule_delays(config) == expected
    pipeline = Emulator(config, record=False).run()
    delayed = train_with_delays(config, expected)
    assert delayed.losses == pipeline.losses
    assert delayed.eval == pipeline.eval
    # The delays matter: without them the same run trains differently.
    assert train_with_delays(config, [0] * 4).losses != pipeline.losses


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_runs_shorter_than_the_pipeline_get_the_steady_delays(steps: int) -> None:
    """Too few mini-batches to reach the steady state: the delays are still N-k-1, and exact."""
    config = _gpt((1, 1, 1, 1), "adam", schedule="async-1f1b", weights="stash", steps=steps)
    assert schedule_delays(config) == (3, 2, 1, 0)
    pipeline = Emulator(config, record=False).run()
    assert train_with_delays(config, (3, 2, 1, 0)).losses == pipeline.losses


@pytest.mark.parametrize(
    "changes",
    [{}, {"lr_warmup": 3}, {"distances": "official"}, {"optimizer": "sgd", "lr": 0.05}],
    ids=["adam", "lr-warmup", "official-distances", "sgd"],
)
def test_stash_image_model_with_warmup_and_distance_rules(changes: dict[str, Any]) -> None:
    """Accuracy too; the warm-up ramps both; the distance rule does not touch stash."""
    config = replace_fields(IMAGE, schedule="async-1f1b", weights="stash", **changes)
    delays = schedule_delays(config)
    assert delays == (3, 3, 2, 2, 1, 0)
    pipeline = Emulator(config, record=False).run()
    delayed = train_with_delays(config, delays)
    assert delayed.losses == pipeline.losses
    assert delayed.eval == pipeline.eval and "accuracy" in delayed.eval


def test_delays_past_the_last_step_train_nothing_that_is_used() -> None:
    """Every gradient is taken at version 0: each loss is the initial model's on its batch."""
    config = _gpt((2, 2), "sgd", steps=4)
    delayed = train_with_delays(config, [config.steps] * 4)
    with single_threaded(), torch.no_grad():
        model = build_full_model(config)
        data = BatchSource(config, model)
        initial = tuple(model.loss(model(x), y).item() for x, y in map(data.batch, range(4)))
    assert delayed.losses == initial


def test_fractional_delays_interpolate_between_versions() -> None:
    config = _gpt((2, 2), "adam")
    zero, half, one = (train_with_delays(config, [d] * 4).losses for d in (0, 0.5, 1))
    # Step 0 sees version 0 whatever the delay; afterwards 0.5 is neither neighbour.
    assert zero[0] == half[0] == one[0]
    assert half[1:] != zero[1:] and half[1:] != one[1:]
    assert train_with_delays(config, [1.0] * 4).losses == one


@pytest.mark.parametrize(
    ("delays", "message"),
    [
        ([0, 0, -1, 0], "must be finite and >= 0"),
        ([0, float("nan"), 0, 0], "must be finite and >= 0"),
        ([0, 0, 0], "3 delays for gpt2-micro, which has 4 layers"),
        ([0] * 5, "give one delay per layer"),
    ],
)
def test_bad_delays_are_refused(delays: list[float], message: str) -> None:
    with pytest.raises(PipeswapError, match=message):
        train_with_delays(GPT, delays)


@pytest.mark.parametrize(
    ("weights", "optimizer", "message"),
    [
        ("stale", "sgd", "two versions is no single delay; use weights stash"),
        ("spectrain", "sgd", "a prediction is no delay; use weights stash"),
        ("predict-adam", "adam", "a prediction is no delay; use weights stash"),
    ],
)
def test_modes_that_are_no_delay_are_refused(weights: str, optimizer: str, message: str) -> None:
    config = _gpt((1, 1, 1, 1), optimizer, schedule="async-1f1b", weights=weights)
    with pytest.raises(PipeswapError, match=message):
        schedule_delays(config)


def test_synchronous_schedules_have_no_delay() -> None:
    for schedule in ("gpipe", "1f1b"):
        config = _gpt((1, 1, 1, 1), "sgd", schedule=schedule, micro_batches=2)
        assert schedule_delays(config) == (0, 0, 0, 0)


@pytest.mark.parametrize("weights", ["stash", "spectrain", "predict-adam", "nesterov"])
def test_weight_modes_on_synchronous_schedules_are_refused(weights: str) -> None:
    # Nothing is stale on a schedule with a flush: a mode there could only mislead.
    for schedule in ("gpipe", "1f1b"):
        with pytest.raises(
            PipeswapError, match=f"weights {weights} chooses .* {schedule} is synchronous"
        ):
            _gpt((1, 1, 1, 1), "adam", schedule=schedule, weights=weights, micro_batches=2)


@pytest.mark.parametrize(
    "schedule,weights,optimizer,micro,delays",
    [
        ("async-1f1b", "nesterov", "adamw", 1, (3, 2, 1, 0)),
        ("async-1f1b", "nesterov", "sgd", 1, (3, 2, 1, 0)),  # its SGD form
        ("2bw", "stash", "sgd", 2, (1, 1, 1, 1)),
    ],
)
def test_nesterov_and_2bw_are_their_delays_without_a_pipeline(
    schedule: str, weights: str, optimizer: str, micro: int, delays: tuple[int, ...]
) -> None:
    config = pipeline_run(
        UNTIED.model,
        (1, 1, 1, 1),
        schedule=schedule,
        weights=weights,
        optimizer=optimizer,
        batch=4,
        seq_len=16,
        steps=8,
        micro_batches=micro,
        lr=0.05 if optimizer == "sgd" else 3e-3,
        delay_lr_power=0.0,  # nesterov as released: the stability rule scales no stage
    )
    assert schedule_delays(config) == delays  # 2bw: one update late at every depth
    assert train_with_delays(config, delays).losses == Emulator(config).run().losses


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_no_delay_is_the_sync_pipeline_of_a_tied_model_with_dropout_bitwise(
    optimizer: str,
) -> None:
    """Tied embedding, dropout, one micro-batch: the RNG streams and the summed tied
    gradient (g_stage0 + g_last, commutative) are plain training's exactly."""
    config = pipeline_run(
        "pipeline_toys:toy_tied_lm",
        (2, 3),
        schedule="1f1b",
        optimizer=optimizer,
        lr=LR[optimizer],
        batch=4,
        steps=5,
        seq_len=16,
    )
    assert schedule_delays(config) == (0,) * 5
    pipeline = Emulator(config, record=False).run()
    delayed = train_with_delays(config, [0] * 5)
    assert delayed.losses == pipeline.losses and delayed.eval == pipeline.eval
    no_dropout = replace_fields(config, model="pipeline_toys:toy_tied_lm_nodrop")
    assert train_with_delays(no_dropout, [0] * 5).losses != delayed.losses


def test_stash_delays_are_the_stash_pipeline_with_dropout_bitwise() -> None:
    config = pipeline_run(
        "pipeline_toys:toy_untied_lm",
        (2, 3),
        schedule="async-1f1b",
        weights="stash",
        batch=4,
        steps=6,
        seq_len=16,
        lr=0.05,
    )
    delays = schedule_delays(config)
    assert delays == (1, 1, 0, 0, 0)
    pipeline = Emulator(config, record=False).run()
    delayed = train_with_delays(config, delays)
    assert delayed.losses == pipeline.losses and delayed.eval == pipeline.eval


def test_tied_layers_need_one_delay_and_async_tied_pipelines_have_none() -> None:
    with pytest.raises(
        PipeswapError, match="'embed' and 'head' share a parameter but have delays 1 and 0"
    ):
        train_with_delays(GPT, [1, 1, 0, 0])
    config = replace_fields(GPT, schedule="async-1f1b", weights="stash")
    with pytest.raises(
        PipeswapError, match=r"ties embed.tokens.weight across stages \[0, 1\].*no per-layer"
    ):
        schedule_delays(config)
