"""pipeswap/schedule/pipeline_config.py: PipelineConfig's defaults and checks."""

from __future__ import annotations

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.schedule.pipeline_config import PipelineConfig, read_balance


def test_stages_or_balance_give_the_stage_count() -> None:
    assert PipelineConfig(stages=3).num_stages == 3
    assert PipelineConfig(balance=(2, 1)).num_stages == 2
    assert PipelineConfig(stages=2, balance=(2, 1)).stage_balance == (2, 1)
    with pytest.raises(ConfigError, match="balance yet"):
        PipelineConfig(stages=2).stage_balance  # noqa: B018


def test_the_micro_batch_default_is_the_schedules() -> None:
    assert PipelineConfig(stages=4).micro_batch_count == 4
    assert PipelineConfig(stages=4, schedule="gpipe", micro_batches=2).micro_batch_count == 2
    assert PipelineConfig(stages=4, schedule="async-1f1b").micro_batch_count == 1
    assert PipelineConfig(stages=4, schedule="async-1f1b").asynchronous
    assert not PipelineConfig(stages=4).asynchronous


@pytest.mark.parametrize(
    "fields,message",
    [
        ({}, "needs stages"),
        ({"stages": 0}, "stages is 0"),
        ({"stages": 3, "balance": (1, 1)}, "balance 1,1 has 2 stages but stages is 3"),
        ({"balance": (2, 0)}, "every stage needs at least one layer"),
        ({"stages": 2, "schedule": "zb"}, "unknown schedule 'zb'"),
        ({"stages": 2, "weights": "guess"}, "unknown weights 'guess'"),
        ({"stages": 2, "distances": "table"}, "schedule, official"),
        ({"stages": 2, "micro_batches": 0}, "micro_batches is 0"),
        ({"stages": 2, "schedule": "async-1f1b", "micro_batches": 2}, "takes no micro_batches"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(**fields)  # type: ignore[arg-type]


def test_a_balance_is_read_from_its_text() -> None:
    assert read_balance("3,3,2") == (3, 3, 2)
    with pytest.raises(ConfigError, match="write layer counts like 3,3,2,2"):
        read_balance("3;3")
