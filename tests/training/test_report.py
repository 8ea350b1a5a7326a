"""pipeswap/training/report.py: one typed report in every mode, its JSON read back as written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.report import REPORT_FORMAT, TrainReport, load_report, write_report
from pipeswap.training.run import train


@pytest.mark.parametrize(
    "mode",
    [
        {"swap": SwapConfig(policy="disjoint", footprint_ratio=1.2)},
        {"pipeline": PipelineConfig(stages=2, schedule="async-1f1b", emulate=True)},
    ],
    ids=["data-parallel", "emulate"],
)
def test_a_report_survives_its_json_file(mode: dict[str, object], tmp_path: Path) -> None:
    config = TrainConfig("gpt2-micro", batch=4, seq_len=16, steps=2, device="cpu", **mode)  # type: ignore[arg-type]
    outcome = train(config)
    assert outcome is not None
    report = outcome.report
    path = tmp_path / "r.json"
    write_report(path, report)
    obj = json.loads(path.read_text())
    assert obj["format"] == REPORT_FORMAT and obj["losses"] == report.losses
    assert load_report(path) == report
    details = report.data_parallel or report.pipeline
    assert details is not None and (report.data_parallel is None) != (report.pipeline is None)
    # The mode's keys sit at the top level of the JSON, next to the common ones.
    assert set(obj) == {
        "format",
        *(k for k in vars(report) if k not in ("data_parallel", "pipeline")),
        *(k for k, v in vars(details).items() if v is not None),
    }
    assert TrainConfig.from_json(report.train_config) == outcome.config


def test_other_files_are_refused_naming_what_to_do(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "pipeswap.swaptrain/1"}))
    with pytest.raises(PipeswapError, match="old format"):
        load_report(old)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"format": REPORT_FORMAT, "mode": "emulate"}))
    with pytest.raises(PipeswapError, match="malformed training report"):
        load_report(broken)
    with pytest.raises(PipeswapError, match="expected format"):
        TrainReport.from_json({"format": "something/1"})
