"""pipeswap: train networks larger than one GPU with contention-aware swapping and pipelines.

The names a user trains with, from one import (each is documented where it lives)::

    import pipeswap
    model = pipeswap.build_model("gpt2-tiny")    # a zoo name, a Hugging Face directory, module:fn
    model = pipeswap.adapt(my_module)            # or any nn.Module, cut at its repeated blocks
    profile = pipeswap.measure(model, batch=8, seq_len=64)    # pipeswap.profiling.estimate: meta
    plan = pipeswap.make_plan(profile, pipeswap.preset("switch-4"), policy="auto", gpus=2,
                              footprint_ratio=1.5).plan
    with pipeswap.SwapExecutor(model, plan) as executor: ...         # a plan of your own
    off = pipeswap.offload(hf_model, footprint_ratio=1.5)   # your loop: `with off:` around
    #                                                         the forward, planned for you
    outcome = pipeswap.train(pipeswap.TrainConfig("gpt2-tiny", steps=5))   # what the CLI runs
    pipe = pipeswap.PipelineConfig(stages=2, schedule="async-1f1b", weights="spectrain")
    outcome = pipeswap.train(pipeswap.TrainConfig("gpt2-tiny", steps=5, pipeline=pipe))
    pipe = pipeswap.Pipeline(hf_model, stages=2, steps=100)  # your torchrun script: one
    loss = pipe.step(x, labels=x)                            # pipe.step per mini-batch

Everything else lives in its subpackage (``pipeswap.sim``, ``pipeswap.swap``,
``pipeswap.pipeline``, ``pipeswap.profiling``, ``pipeswap.hardware``, ``pipeswap.dist``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pipeswap.errors import PipeswapError
from pipeswap.version import __version__

# Imported on first use, so that `import pipeswap` (and the CLI's start) stays quick.
_PUBLIC = {
    "adapt": "pipeswap.models.adapt",
    "build_model": "pipeswap.models.registry",
    "measure": "pipeswap.profiling.measure",
    "offload": "pipeswap.training.offload",
    "Pipeline": "pipeswap.training.pipe",
    "preset": "pipeswap.hardware.presets",
    "make_plan": "pipeswap.swap.plan.planner",
    "SwapExecutor": "pipeswap.swap.runtime.executor",
    "PipelineConfig": "pipeswap.schedule.pipeline_config",
    "SwapConfig": "pipeswap.swap.swap_config",
    "OptimizerConfig": "pipeswap.optim",
    "CheckpointConfig": "pipeswap.checkpoint",
    "ConfigError": "pipeswap.config_fields",
    "TrainConfig": "pipeswap.train_config",
    "train": "pipeswap.training.run",
}

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "OptimizerConfig",
    "Pipeline",
    "PipelineConfig",
    "PipeswapError",
    "SwapConfig",
    "SwapExecutor",
    "TrainConfig",
    "__version__",
    "adapt",
    "build_model",
    "make_plan",
    "measure",
    "offload",
    "preset",
    "train",
]

if TYPE_CHECKING:
    from pipeswap.checkpoint import CheckpointConfig
    from pipeswap.config_fields import ConfigError
    from pipeswap.hardware.presets import preset
    from pipeswap.models.adapt import adapt
    from pipeswap.models.registry import build_model
    from pipeswap.optim import OptimizerConfig
    from pipeswap.profiling.measure import measure
    from pipeswap.schedule.pipeline_config import PipelineConfig
    from pipeswap.swap.plan.planner import make_plan
    from pipeswap.swap.runtime.executor import SwapExecutor
    from pipeswap.swap.swap_config import SwapConfig
    from pipeswap.train_config import TrainConfig
    from pipeswap.training.offload import offload
    from pipeswap.training.pipe import Pipeline
    from pipeswap.training.run import train


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeswap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
