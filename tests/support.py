"""Shared test support: configs of small pipeline runs, and hand-built profiles."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pipeswap.config_fields import replace_fields
from pipeswap.optim import OptimizerConfig
from pipeswap.profiling.profile import LayerProfile, Profile, SavedTensor
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig


def pipeline_run(
    model: str,
    balance: tuple[int, ...],
    *,
    batch: int = 8,
    steps: int = 10,
    lr: float = 0.01,
    micro_batches: int = 1,
    **fields: Any,
) -> TrainConfig:
    """A pipeline run of ``model`` cut at ``balance``, with the small defaults the pipeline
    tests were written for (batch 8, 10 steps, SGD at 0.01, one micro-batch); ``fields``
    sets any other field of the config tree by name (``schedule="gpipe"``, ``seq_len=16``)."""
    base = TrainConfig(
        model,
        batch=batch,
        steps=steps,
        optim=OptimizerConfig(optimizer="sgd", lr=lr),
        pipeline=PipelineConfig(balance=balance, micro_batches=micro_batches),
    )
    return replace_fields(base, **fields) if fields else base


GB = 10**9


def toy_layer(
    name: str,
    forward_s: float,
    backward_s: float,
    *,
    param_bytes: int = 0,
    output_bytes: int = 0,
    saved: Iterable[int | SavedTensor] = (),
    workspace_bytes: int = 0,
) -> LayerProfile:
    """A layer saving ``saved``: byte counts (indexes 0, 1, ...) or SavedTensors as they are."""
    tensors = tuple(
        s if isinstance(s, SavedTensor) else SavedTensor(i, int(s)) for i, s in enumerate(saved)
    )
    return LayerProfile(
        name, forward_s, backward_s, param_bytes, output_bytes, tensors, workspace_bytes
    )


def toy_profile_of(
    layers: Iterable[LayerProfile],
    *,
    model: str = "toy",
    batch: int = 1,
    dtype: str = "float32",
    source: str = "estimate",
    device: str = "toy-gpu",
    optimizer: str = "sgd",
    optimizer_state_bytes: int = 0,
    **extra: Any,
) -> Profile:
    """A profile of ``layers``; ``extra`` sets Profile's optional fields (``seq_len=8``)."""
    return Profile(
        model,
        batch,
        dtype,
        source,
        device,
        optimizer,
        optimizer_state_bytes,
        tuple(layers),
        **extra,
    )


def toy_profile(
    sizes_gb: Sequence[Sequence[float]],
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    param_bytes: int = GB // 100,
    workspace_bytes: int = 0,
    output_gb: float = 0.0,
) -> Profile:
    """One layer per entry of ``sizes_gb``, each saving tensors of those sizes (GB); every
    layer's output is ``output_gb`` (what a recomputed next layer keeps)."""
    return toy_profile_of(
        toy_layer(
            f"l{i}",
            forward_s,
            backward_s,
            param_bytes=param_bytes,
            output_bytes=int(output_gb * GB),
            saved=[size * GB for size in sizes],
            workspace_bytes=workspace_bytes,
        )
        for i, sizes in enumerate(sizes_gb)
    )
