"""How many ranks this machine holds: a run that asks for more is refused before it starts.

Local ranks are processes: each a Python interpreter with PyTorch (about 350 MB resident
before its model; counted as :data:`PROCESS_RANK_BYTES`) and its share of a core (at most
:data:`RANKS_PER_CORE` ranks a core: beyond that they wait on each other past any timeout).
An emulated pipeline holds every rank in this process (about 10 MB each for the smallest
zoo model; counted as :data:`EMULATED_RANK_BYTES`) and one whole model per replica. On
the CPU each rank (each replica, emulated) also holds its model's weights, gradients and
optimizer state. Under torchrun each process is one rank, and the launcher counts them.
"""

from __future__ import annotations

import torch

from pipeswap.config_fields import ConfigError
from pipeswap.dist.env import torchrun_env
from pipeswap.dist.threads import usable_cpus
from pipeswap.models.fits import memory_bytes
from pipeswap.models.registry import build_model, count_parameters, model_spec
from pipeswap.models.seq2seq import load_seq2seq
from pipeswap.optim import STATE_BUFFERS
from pipeswap.train_config import TrainConfig
from pipeswap.units import format_bytes

__all__ = ["EMULATED_RANK_BYTES", "PROCESS_RANK_BYTES", "RANKS_PER_CORE", "check_ranks"]

RANKS_PER_CORE = 4
PROCESS_RANK_BYTES = 256 * 2**20
EMULATED_RANK_BYTES = 8 * 2**20


def _state_bytes(config: TrainConfig) -> int:
    """One whole model's float32 weights, gradients and optimizer state, when they live in
    host memory (the CPU); 0 on a GPU."""
    if config.device != "cpu":
        return 0
    name = config.model
    encoder_decoder = model_spec(name).encoder_decoder  # built whole, not cut into layers
    meta = (
        load_seq2seq(name, device="meta") if encoder_decoder else build_model(name, device="meta")
    )
    params = count_parameters(meta)
    return params * 4 * (2 + STATE_BUFFERS.get(config.optim.name, 2))


def check_ranks(config: TrainConfig) -> None:
    """Refuse a resolved config that asks for more local ranks than this machine holds,
    naming the bound and what sets it (a ConfigError), before anything starts."""
    pipeline = config.pipeline
    if torchrun_env() is not None and config.nproc is None and not (pipeline and pipeline.emulate):
        return  # torchrun started this process as one rank
    if pipeline is None:
        ranks, asked = config.nproc or 1, f"{{nproc}} {config.nproc}"
    else:
        ranks = max(pipeline.num_ranks, config.nproc or 0)
        asked = f"{{stages}} {pipeline.num_stages} x {{replicas}} {pipeline.replicas}"
        asked += f" ({{nproc}} {config.nproc})" if config.nproc is not None else ""
    if ranks <= 1:
        return
    memory = memory_bytes(torch.device("cpu"))
    state = _state_bytes(config)
    if pipeline is not None and pipeline.emulate:
        replica = pipeline.num_stages * EMULATED_RANK_BYTES + state
        if memory is not None and pipeline.replicas > memory // replica:
            held = f", {format_bytes(state)} of weights, gradients and optimizer state"
            raise ConfigError(
                f"{{emulate}} of {asked} holds {ranks:,} ranks in this process, about "
                f"{format_bytes(replica)} a replica ({format_bytes(EMULATED_RANK_BYTES)} a rank"
                f"{held if state else ''}): at most {memory // replica:,} replicas fit this "
                f"machine's {format_bytes(memory)} of memory; lower {{replicas}}"
            )
        return
    cores = usable_cpus()
    per_rank = PROCESS_RANK_BYTES + state
    bounds = [(cores * RANKS_PER_CORE, f"{RANKS_PER_CORE} ranks a core x {cores} cores")]
    if memory is not None:
        bounds.append(
            (memory // per_rank, f"{format_bytes(memory)} / {format_bytes(per_rank)} a rank")
        )
    most = min(bound for bound, _ in bounds)
    if ranks > most:
        why = "; ".join(f"{reason} = {bound:,}" for bound, reason in bounds)
        lower = "{nproc}" if pipeline is None else "{replicas} or {nproc}"
        raise ConfigError(
            f"{asked} asks for {ranks:,} local processes, more than this machine holds: at "
            f"most {most:,} ({why}); lower {lower}, or spread the ranks over machines with "
            "torchrun"
        )
