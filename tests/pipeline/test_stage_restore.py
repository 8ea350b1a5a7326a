"""pipeswap/pipeline/stage_restore.py: a stage continues from its checkpoint with its
in-flight forwards rebuilt (an async cut), as if it had never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from support import pipeline_run

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.pipeline.emulator import Emulator

CONFIG = pipeline_run(
    "gpt2-micro", (2, 2), batch=4, seq_len=16, steps=6, schedule="async-1f1b", weights="stale"
)


def test_every_stage_restores_its_in_flight_work(tmp_path: Path) -> None:
    alone = Emulator(CONFIG).run()
    Emulator(CONFIG, checkpoint=CheckpointPlan(str(tmp_path), 3, {"t": 1}, 2)).run()
    resumed = Emulator(CONFIG, resume=(str(tmp_path), 3)).run()
    assert resumed.losses == alone.losses and resumed.params_sha256 == alone.params_sha256


def test_a_resumed_stage_has_its_buffers_back(tmp_path: Path) -> None:
    """BatchNorm's running statistics (buffers, not weights) are saved at the cut and put
    back after the in-flight forwards run again: the resumed run ends with the buffers of
    the run that never stopped."""
    from safetensors.torch import load_file

    def config(name: str) -> Any:
        return pipeline_run(
            "resnet-micro",
            (3, 3),
            batch=4,
            steps=4,
            schedule="async-1f1b",
            weights="stale",
            save=str(tmp_path / name),
        )

    Emulator(config("alone")).run()
    Emulator(config("first"), checkpoint=CheckpointPlan(str(tmp_path / "ck"), 2, {"t": 1}, 2)).run()
    Emulator(config("resumed"), resume=(str(tmp_path / "ck"), 2)).run()
    alone = load_file(str(tmp_path / "alone" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert any("running_mean" in name for name in alone)
    for name, tensor in alone.items():
        assert torch.equal(resumed[name], tensor), name
