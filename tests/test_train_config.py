"""pipeswap/train_config.py: one run composed of its components' configs, checked across them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pipeswap.checkpoint import CheckpointConfig
from pipeswap.config_fields import ConfigError
from pipeswap.optim import OptimizerConfig
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig


def test_the_mode_follows_which_component_is_set() -> None:
    assert TrainConfig("gpt2-micro").mode == "data-parallel"
    assert TrainConfig("gpt2-micro", pipeline=PipelineConfig(stages=2)).mode == "pipeline"
    emulated = PipelineConfig(stages=2, emulate=True)
    assert TrainConfig("gpt2-micro", pipeline=emulated).mode == "emulate"
    # A pipeline with swap settings is a pipeline whose stages swap; it keeps them.
    swapping = TrainConfig("gpt2-micro", swap=SwapConfig(), pipeline=PipelineConfig(stages=2))
    assert swapping.mode == "pipeline" and swapping.resolved().swap == SwapConfig()
    assert TrainConfig("gpt2-micro", pipeline=PipelineConfig(stages=2)).resolved().swap is None


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"batch": 0}, "batch is 0"),
        ({"steps": 0}, "steps must be at least 1"),
        ({"seed": -1}, "seed is -1"),
        ({"timeout_s": float("nan")}, "timeout_s is nan"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
        ({"checkpoint": CheckpointConfig(checkpoint_every=2)}, "checkpoint_every needs"),
    ],
)
def test_run_fields_are_checked_when_built(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(TrainConfig("gpt2-micro"), **changes)


@pytest.mark.parametrize(
    "optim,weights,message",
    [
        (OptimizerConfig(optimizer="sgd", momentum=0.0), "spectrain", "SGD momentum buffer"),
        (OptimizerConfig(optimizer="adam"), "spectrain", "predict-adam"),
        (OptimizerConfig(optimizer="sgd"), "predict-adam", "Adam's step direction"),
        (OptimizerConfig(optimizer="sgd", momentum=0.0), "nesterov", "Nesterov momentum"),
    ],
)
def test_a_weight_mode_needs_its_optimizer(
    optim: OptimizerConfig, weights: str, message: str
) -> None:
    pipe = PipelineConfig(stages=2, schedule="async-1f1b", weights=weights)
    with pytest.raises(ConfigError, match=message):
        TrainConfig("gpt2-micro", optim=optim, pipeline=pipe)


def test_pipeline_settings_that_need_another_component() -> None:
    with pytest.raises(ConfigError, match="one rank per stage"):
        TrainConfig("gpt2-micro", nproc=3, pipeline=PipelineConfig(stages=2))
    with pytest.raises(ConfigError, match="drop nproc"):
        TrainConfig("gpt2-micro", nproc=2, pipeline=PipelineConfig(stages=2, emulate=True))
    cap = PipelineConfig(stages=2, memory_cap_bytes=2**30)
    with pytest.raises(ConfigError, match="needs profile_path"):
        TrainConfig("gpt2-micro", pipeline=cap)


def test_resolved_fills_the_models_defaults_once() -> None:
    resolved = TrainConfig("gpt2-micro", device="cpu").resolved()
    assert (resolved.batch, resolved.seq_len, resolved.image_size) == (4, 32, None)
    assert resolved.swap == SwapConfig() and resolved.resolved() == resolved
    image = TrainConfig("resnet-micro", device="cpu").resolved()
    assert (image.seq_len, image.image_size) == (None, 32)
    with pytest.raises(ConfigError, match="image model: pass image_size, not seq_len"):
        TrainConfig("resnet-micro", seq_len=8).resolved()
    with pytest.raises(ConfigError, match="language model: pass seq_len, not image_size"):
        TrainConfig("gpt2-micro", image_size=8).resolved()


def test_json_round_trip() -> None:
    config = TrainConfig(
        "gpt2-micro",
        batch=4,
        optim=OptimizerConfig(optimizer="adam", lr=1e-3),
        pipeline=PipelineConfig(balance=(1, 1), schedule="gpipe"),
        checkpoint=CheckpointConfig(checkpoint_dir="ck", checkpoint_every=2),
    )
    obj = config.to_json()
    assert obj["mode"] == "pipeline" and obj["pipeline"]["balance"] == [1, 1]
    assert TrainConfig.from_json(obj) == config
    assert TrainConfig.from_json(TrainConfig("gpt2-micro").to_json()) == TrainConfig("gpt2-micro")


def test_a_config_written_with_sync_every_reads_as_accumulate() -> None:
    obj = TrainConfig("gpt2-micro", swap=SwapConfig()).to_json()
    obj["swap"]["sync_every"] = 3
    assert TrainConfig.from_json(obj).optim.accumulate == 3


@pytest.mark.parametrize("sizes", [{"seq_len": 32}, {}])
def test_a_classifier_of_token_sequences_is_refused_as_one_not_as_an_image_model(
    tmp_path: Path, sizes: dict[str, int]
) -> None:
    """A BertForSequenceClassification directory: neither 'is an image model' nor a crash
    in its embeddings fed images, whatever size is given."""
    pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    config = hf_config("bert")
    config.architectures = ["BertForSequenceClassification"]
    config.save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match="classifies token sequences"):
        TrainConfig(str(tmp_path / "bert"), batch=2, steps=1, **sizes).resolved()
