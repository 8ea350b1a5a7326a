"""pipeswap/pipeline/stage_restore.py: a stage continues from its checkpoint with its
in-flight forwards rebuilt (an async cut), as if it had never stopped."""

from __future__ import annotations

from pathlib import Path

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
