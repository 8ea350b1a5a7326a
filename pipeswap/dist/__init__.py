"""The only code that starts processes and touches process groups: launch, backends, failure."""

from pipeswap.dist.digest import combine_digests, parameter_digests, params_sha256
from pipeswap.dist.env import RankEnv, free_port, torchrun_env
from pipeswap.dist.group import backend_for, init_process_group, rank_device, single_threaded
from pipeswap.dist.launch import LaunchResult, RankFailedError, run_ranks, spawn

__all__ = [
    "LaunchResult",
    "RankEnv",
    "RankFailedError",
    "backend_for",
    "combine_digests",
    "free_port",
    "init_process_group",
    "parameter_digests",
    "params_sha256",
    "rank_device",
    "run_ranks",
    "single_threaded",
    "spawn",
    "torchrun_env",
]
