"""examples/pipeline_torchrun.py, a user's torchrun script over their own Llama and tokens:
gpipe and 1f1b give plain training's losses and weights, async-1f1b the emulator's bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeswap.data_config import DataConfig
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.feed import FedBatches
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig
from tests.models.hf_configs import save_model

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pipeline_torchrun.py"
BATCH, SEQ_LEN, STEPS, LR = 8, 32, 4, 1e-3


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp("user")
    model = save_model(root / "llama", "llama", tie_word_embeddings=True)  # tied across stages
    tokens = np.random.default_rng(0).integers(0, 256, BATCH * SEQ_LEN * STEPS + 7)
    np.save(root / "tokens.npy", tokens.astype(np.uint16))
    return model, root / "tokens.npy"


def _torchrun(model: str, tokens: Path, out: Path, *flags: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        model,
        str(tokens),
        "--out",
        str(out),
        "--batch",
        str(BATCH),
        "--seq-len",
        str(SEQ_LEN),
        "--lr",
        str(LR),
        "--balance",
        "2,2",
        *flags,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "losses.json").read_text())
    return result


def _batches(tokens: Path) -> list[torch.Tensor]:
    """The script's loader, batch by batch."""
    ids = torch.from_numpy(np.load(tokens).astype(np.int64))
    windows = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    loader = torch.utils.data.DataLoader(
        windows,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )
    return list(loader)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_a_synchronous_pipeline_trains_as_the_plain_loop(
    user_files: tuple[str, Path], tmp_path: Path, schedule: str
) -> None:
    model_dir, tokens = user_files
    ran = _torchrun(model_dir, tokens, tmp_path / "out", "--schedule", schedule)
    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0)
    expected = []
    for batch in _batches(tokens):
        total = 0.0
        for part in batch.chunk(2):  # two micro-batches: one per stage, the default
            loss = plain(input_ids=part, labels=part).loss
            (loss / 2).backward()
            total += loss.item() / 2
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    assert ran["losses"] == pytest.approx(expected, rel=1e-5)
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", local_files_only=True
    )
    for (name, mine), theirs in zip(
        trained.state_dict().items(), plain.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5, msg=name)


def test_an_asynchronous_pipeline_is_the_emulated_run_bit_for_bit(
    user_files: tuple[str, Path], tmp_path: Path
) -> None:
    model_dir, tokens = user_files
    flags = ("--schedule", "async-1f1b", "--weights", "predict-adam")
    ran = _torchrun(model_dir, tokens, tmp_path / "out", *flags)
    config = TrainConfig(
        model_dir,
        batch=BATCH,
        seq_len=SEQ_LEN,
        steps=STEPS,
        optim=OptimizerConfig(optimizer="adamw", lr=LR, weight_decay=0.0),
        pipeline=PipelineConfig(balance=(2, 2), schedule="async-1f1b", weights="predict-adam"),
        dataset=DataConfig(eval_batches=0),
    )
    fed = FedBatches(BATCH)
    for step, batch in enumerate(_batches(tokens)):
        # What labels= becomes: the next token of each position, none after the last.
        target = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
        fed.batches[step] = (batch, target)
    emulated = Emulator(config, data=fed).run()
    assert tuple(ran["losses"]) == emulated.losses
    assert isinstance(ran["held_out"], float)
