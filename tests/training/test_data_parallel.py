"""pipeswap/training/data_parallel.py: the profile a run plans from, made within its budget."""

from __future__ import annotations

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
