"""Replicated pipelines (pipeline x data parallel): 2 replicas of 2 stages in 4 gloo ranks
equal their emulation bit for bit, and synchronous ones train like plain training on the
replicas' batches side by side.

Covers: pipeswap/pipeline/runtime.py and pipeswap/pipeline/emulator.py with replicas,
pipeswap/dist/replica_groups.py (ReplicaMesh).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from runtime_check import assert_runtime_matches_emulator, train_checkpointed
from support import pipeline_run

from pipeswap.checkpoint import CheckpointPlan, latest_complete
from pipeswap.config_fields import replace_fields
from pipeswap.dist.digest import params_sha256
from pipeswap.dist.faults import FAULT_ENV
from pipeswap.dist.group import single_threaded
from pipeswap.dist.launch import spawn
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.job import BatchSource, build_full_model
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.train_config import TrainConfig

pytestmark = pytest.mark.dist


def _tied(model: str = "pipeline_toys:toy_tied_lm", **fields: object) -> TrainConfig:
    # A tied embedding on both stages of each replica; dropout draws per replica.
    given = {"steps": 4, **fields}
    return pipeline_run(model, (2, 3), batch=4, seq_len=16, lr=0.05, replicas=2, **given)


def plain_on_both_batches(config: TrainConfig) -> tuple[list[float], str]:
    """One process, the whole model, each step on the replicas' batches side by side (one
    batch of D x ``batch`` samples): (losses, digest)."""
    config = resolve_pipeline(config)
    replicas = config.require_pipeline().replicas
    with single_threaded():
        model = build_full_model(config)
        optimizer = config.optim.build(list(model.parameters()))
        sources = [BatchSource(config, model, "train", d) for d in range(replicas)]
        losses = []
        for step in range(config.steps):
            pairs = [source.batch(step) for source in sources]
            x = torch.cat([x for x, _ in pairs])
            y = torch.cat([y for _, y in pairs])
            loss = model.loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
    return losses, params_sha256(model)


def test_two_replicas_of_two_stages_equal_their_emulation_bit_for_bit() -> None:
    configs = [
        _tied(schedule="1f1b", micro_batches=2),
        _tied(schedule="async-1f1b", weights="spectrain"),
        _tied(schedule="gpipe", micro_batches=2, clip_grad_norm=0.5, eval_batches=1, eval_every=2),
        _tied("pipeline_toys:toy_tied_lm_nodrop", schedule="1f1b", micro_batches=2),
    ]
    reports = assert_runtime_matches_emulator(configs, 4)
    # The replicas matter: one pipeline on replica 0's batches alone trains otherwise.
    alone = Emulator(replace_fields(configs[0], replicas=1)).run()
    assert alone.params_sha256 != reports[0]["params_sha256"]
    # A synchronous replicated run is plain training on both replicas' batches at once.
    want, _ = plain_on_both_batches(configs[3])
    for got, expected in zip(reports[3]["losses"], want, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_replicated_synchronous_pipeline_is_plain_training_on_both_batches(
    schedule: str,
) -> None:
    config = _tied("pipeline_toys:toy_tied_lm_nodrop", schedule=schedule, micro_batches=2)
    emulated = Emulator(config).run()
    want, _ = plain_on_both_batches(config)
    for got, expected in zip(emulated.losses, want, strict=True):
        assert abs(got - expected) <= 1e-5 * abs(expected)
    # Each replica reads its own batches: replica 1's first batch is not replica 0's.
    resolved = resolve_pipeline(config)
    model = build_full_model(resolved)
    first = [BatchSource(resolved, model, "train", d).batch(0)[0] for d in (0, 1)]
    assert not torch.equal(first[0], first[1])


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_a_replicated_pipeline_killed_mid_run_resumes_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the 4 ranks writes its own file (rank d x K + k); a run killed after step 4
    resumes from step 4 in processes, and the emulator resumes from the same files."""
    config = _tied(schedule="async-1f1b", weights="spectrain", steps=8, timeout_s=10)
    alone = Emulator(config).run()
    plan = CheckpointPlan(str(tmp_path), 2, {"test": "replicas"}, 4)
    monkeypatch.setenv(FAULT_ENV, "3:4")  # replica 1's last stage is SIGKILLed after step 4
    killed = spawn(train_checkpointed, 4, config, plan, None, timeout_s=10)
    assert not killed.ok and killed.exit_codes[3] == -9
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == 4
    assert sorted(found[1]["files"]) == [f"rank-{r}.pt" for r in range(4)]
    monkeypatch.delenv(FAULT_ENV)
    resumed = spawn(train_checkpointed, 4, config, None, (str(tmp_path), 4), timeout_s=10)
    assert resumed.ok, resumed.exit_codes
    assert resumed.results[0] == (alone.losses, alone.params_sha256)
    emulated = Emulator(config, resume=(str(tmp_path), 2)).run()
    assert (emulated.losses, emulated.params_sha256) == (alone.losses, alone.params_sha256)
