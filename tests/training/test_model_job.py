"""What a data-parallel rank trains: a model by name and its batches, train or held out.

Covers: pipeswap/training/job.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.data_config import DataConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.job import ModelJob


def test_a_job_takes_the_resolved_config_and_its_batches_repeat_by_index() -> None:
    config = TrainConfig("gpt2-micro", batch=4, seq_len=16, swap=SwapConfig()).resolved()
    job = ModelJob.of(config)
    assert (job.model, job.batch_size, job.seq_len) == ("gpt2-micro", 4, 16)
    first, again = job.batch(3), job.batch(3)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    held = job.batch(3, "val")
    assert held[0].shape == first[0].shape and not torch.equal(held[0], first[0])


def test_a_job_on_the_users_data_reads_the_held_out_file_for_val(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("a" * 400)
    (tmp_path / "held.txt").write_text("b" * 100)
    data = DataConfig(data=str(tmp_path / "train.txt"), eval_data=str(tmp_path / "held.txt"))
    config = TrainConfig("gpt2-micro", batch=2, seq_len=8, dataset=data).resolved()
    job = ModelJob.of(config)
    assert set(job.batch(0)[0].flatten().tolist()) == {ord("a")}
    assert set(job.batch(0, "val")[0].flatten().tolist()) == {ord("b")}


def test_a_bad_held_out_file_is_named_as_eval_data(tmp_path: Path) -> None:
    """Hostile input round 4: a bad --eval-data was reported as --data."""
    (tmp_path / "train.txt").write_text("a" * 400)
    missing = tmp_path / "held.txt"
    data = DataConfig(data=str(tmp_path / "train.txt"), eval_data=str(missing))
    config = TrainConfig("gpt2-micro", batch=2, seq_len=8, dataset=data).resolved()
    job = ModelJob.of(config)
    job.batch(0)
    with pytest.raises(ConfigError) as refused:
        job.batch(0, "val")
    assert refused.value.message.startswith(f"{{eval_data}} {missing} does not exist")
