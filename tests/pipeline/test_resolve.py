"""pipeswap/pipeline/resolve.py: a pipeline run made concrete, the same on every rank."""

from __future__ import annotations

import pytest
from support import pipeline_run

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig


def test_the_partitioner_balances_the_stages_and_resolving_again_changes_nothing() -> None:
    config = TrainConfig("gpt2-micro", batch=4, pipeline=PipelineConfig(stages=2))
    resolved = resolve_pipeline(config)
    pipeline = resolved.require_pipeline()
    assert sum(pipeline.stage_balance) == 4 and pipeline.micro_batches == 2
    assert (resolved.seq_len, resolved.device) == (32, "cpu")
    assert resolve_pipeline(resolved) == resolved


def test_a_given_balance_is_checked_against_the_model() -> None:
    config = TrainConfig("gpt2-micro", batch=4, pipeline=PipelineConfig(balance=(3, 2)))
    with pytest.raises(ConfigError, match="add up to the model's 4 layers"):
        resolve_pipeline(config)
    # Before: balance (1, 1) for 2 blocks was refused without saying that it counts the
    # embedding and the head too.
    blocks = TrainConfig("gpt2-micro", batch=4, pipeline=PipelineConfig(balance=(1, 1)))
    with pytest.raises(
        ConfigError,
        match="the embedding and the head as well as the blocks: embed, block0, block1, head$",
    ):
        resolve_pipeline(blocks)
    many = TrainConfig("gpt2-micro", batch=4, pipeline=PipelineConfig(stages=9))
    with pytest.raises(ConfigError, match="fewer than the 9 stages"):
        resolve_pipeline(many)


def test_the_batch_must_split_into_the_micro_batches() -> None:
    default = TrainConfig("gpt2-micro", batch=3, pipeline=PipelineConfig(stages=2))
    with pytest.raises(ConfigError, match="pass micro_batches M with M dividing 3"):
        resolve_pipeline(default)
    given = TrainConfig("gpt2-micro", batch=4, pipeline=PipelineConfig(stages=2, micro_batches=3))
    with pytest.raises(ConfigError, match="equal parts"):
        resolve_pipeline(given)


def test_accumulation_is_a_larger_mini_batch_in_more_micro_batches() -> None:
    base = pipeline_run("gpt2-micro", (2, 2), batch=4, seq_len=16, steps=3, schedule="1f1b")
    accumulated = replace_fields(base, micro_batches=2, accumulate=3)
    resolved = resolve_pipeline(accumulated)
    assert (resolved.batch, resolved.require_pipeline().micro_batches) == (12, 6)
    assert resolved.optim.accumulate == 1 and resolve_pipeline(resolved) == resolved
    run = Emulator(accumulated, record=False).run()
    same = Emulator(replace_fields(base, batch=12, micro_batches=6), record=False).run()
    assert (run.losses, run.params_sha256) == (same.losses, same.params_sha256)
    with pytest.raises(ConfigError, match="accumulate 2: schedule async-1f1b pipelines whole"):
        replace_fields(base, schedule="async-1f1b", micro_batches=None, accumulate=2)
