"""pipeswap/training/data_parallel.py: the profile a run plans from, made within its budget."""

from __future__ import annotations

import pytest
import torch

from pipeswap.optim import OptimizerConfig
from pipeswap.profiling.meter import StorageMeter
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.data_parallel import _profile
from pipeswap.training.job import job_for


def _run(policy: str) -> TrainConfig:
    return TrainConfig(
        "gpt2-micro",
        batch=16,
        seq_len=64,
        device="cpu",
        swap=SwapConfig(policy=policy),
        optim=OptimizerConfig(optimizer="sgd"),
    ).resolved()


def test_a_run_that_swaps_profiles_its_model_with_the_saved_tensors_on_the_host() -> None:
    cpu = torch.device("cpu")
    plain = _profile(_run("none"), job_for(_run("none")), cpu)
    swapping = _run("recompute")
    job = job_for(swapping)
    with StorageMeter("cpu") as meter:
        profile = _profile(swapping, job, cpu)
    assert profile.notes["saved_on_host"] and not plain.notes["saved_on_host"]
    assert [layer.saved for layer in profile.layers] == [layer.saved for layer in plain.layers]
    no_swap = plain.memory.turn_peak_bytes  # the step's peak: the turn, for this model
    assert no_swap > max(*plain.memory.forward_peak_bytes, *plain.memory.backward_peak_bytes)
    assert profile.memory == plain.memory  # what the step as it is holds, to the byte
    # Profiling held what a plan that swaps everything holds, not the no-swap peak (the
    # meter counts the model too: it is built inside it).
    assert meter.peak <= 0.6 * no_swap


@pytest.mark.slow
def test_accumulating_in_bf16_keeps_the_budget_the_gradients_held_included(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With --accumulate, the gradients of the micro-batches before are held through the
    next one's forward and backward: the no-swap peak and every plan count them."""
    from pipeswap.training.run import train
    from tests.models.hf_configs import save_config

    # Weights a sizeable share of the step: the gradients held then decide the peak.
    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, vocab_size=512)
    model = save_config(tmp_path / "llama", "llama", max_position_embeddings=128, **size)

    def run(policy: str, ratio: float) -> dict:  # type: ignore[type-arg]
        config = TrainConfig(
            model,
            batch=8,
            seq_len=128,
            steps=2,
            device="cpu",
            precision="bf16-mixed",
            swap=SwapConfig(policy=policy, footprint_ratio=ratio, time_limit_s=1),
            optim=OptimizerConfig(accumulate=2),
        )
        outcome = train(config)
        assert outcome is not None
        return outcome.report.to_json()

    plain = run("none", 1.0)
    swapped = run("hybrid", 1.5)
    assert swapped["losses"] == plain["losses"]
    assert swapped["params_sha256"] == plain["params_sha256"]
    no_swap = plain["peak_resident_bytes"][0]
    assert swapped["budget_bytes"] >= no_swap / 1.5 * 0.98  # the ratio of the peak as it is
    assert swapped["peak_resident_bytes"][0] <= swapped["budget_bytes"] * 1.02


def test_a_plan_for_accumulated_steps_counts_the_gradients_held() -> None:
    from pipeswap.profiling.profile import Profile
    from pipeswap.training.data_parallel import _plan

    def planned(accumulate: int) -> Profile:
        config = TrainConfig(
            "gpt2-micro",
            batch=4,
            seq_len=32,
            device="cpu",
            swap=SwapConfig(policy="hybrid", footprint_ratio=1.2, time_limit_s=1),
            optim=OptimizerConfig(accumulate=accumulate),
        ).resolved()
        return Profile.from_json(_plan(config, 1, torch.device("cpu")).profile)

    once, accumulated = planned(1), planned(2)
    assert once.memory is not None and accumulated.memory is not None
    held = accumulated.peak_training_bytes() - once.peak_training_bytes()
    assert held == once.param_bytes  # the gradients, through the second micro-batch
