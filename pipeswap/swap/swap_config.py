"""SwapConfig: how data-parallel training swaps, declared and checked once; the swap policies.

A swap policy is one :class:`PolicyKind` entry of :data:`POLICY_KINDS` (its name, and
what a pipeline's stages may do under it) plus its algorithm, the entry of the same
name in :data:`pipeswap.swap.plan.policy_table.POLICIES` (how it plans, whether it keeps
to the budget). The config's choices, the planner and the stages that swap ask them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError, option, require
from pipeswap.units import parse_bytes

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "POLICY_KINDS",
    "POLICY_NAMES",
    "PolicyKind",
    "StageMoves",
    "SwapConfig",
    "policy_kind",
]


@dataclass(frozen=True)
class StageMoves:
    """What a pipeline's stages may do under a policy, each planned from its own timeline
    (pipeswap.swap.plan.stage_plans): ``swap`` saved tensors to host memory, ``recompute``
    layers, ``coordinated`` with the stages that share its PCIe switch (False: each as if
    its link were its own, Mobius-like). ``every_layer``: every layer's saved tensors go
    to host memory, unplanned (PyTorch's save_on_cpu). None of these: they keep everything.
    """

    swap: bool = False
    recompute: bool = False
    coordinated: bool = True
    every_layer: bool = False

    @property
    def moves_anything(self) -> bool:
        return self.swap or self.recompute or self.every_layer


@dataclass(frozen=True)
class PolicyKind:
    """One swap policy: its name, and ``stages``, what a pipeline's stages do under it
    (None: it plans data-parallel swaps only, and a pipeline refuses it)."""

    name: str
    stages: StageMoves | None


POLICY_KINDS: dict[str, PolicyKind] = {
    kind.name: kind
    for kind in (
        PolicyKind("none", StageMoves()),
        PolicyKind("oblivious", StageMoves(swap=True, coordinated=False)),
        PolicyKind("disjoint", StageMoves(swap=True)),
        PolicyKind("bidirectional", StageMoves(swap=True)),
        PolicyKind("recompute", StageMoves(recompute=True)),
        PolicyKind("save-on-cpu", StageMoves(every_layer=True)),
        # A stage recomputes whole blocks (a stage plan has no selective recomputation).
        PolicyKind("finer", StageMoves(recompute=True)),
        PolicyKind("hybrid", StageMoves(swap=True, recompute=True)),
        PolicyKind("mip", None),
        PolicyKind("auto", StageMoves(swap=True, recompute=True)),
    )
}
POLICY_NAMES = tuple(POLICY_KINDS)
DEFAULT_BUCKET_BYTES = 25 * 2**20


def policy_kind(name: str) -> PolicyKind:
    """The entry of the swap policy ``name``; a ConfigError naming the valid ones otherwise."""
    kind = POLICY_KINDS.get(name)
    if kind is None:
        raise ConfigError(
            f"{{policy}} {name!r} is not a swap policy; use one of " + ", ".join(POLICY_KINDS)
        )
    return kind


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """Which saved tensors go to host memory, within which budget, planned for which GPUs.

    The budget per GPU is ``gpu_memory_bytes``, or the no-swap peak divided by
    ``footprint_ratio``, or else the topology's GPU memory.
    """

    policy: str = option(
        "auto",
        choices=POLICY_NAMES,
        help="which saved tensors go to host memory, and when: auto keeps the best simulated "
        "plan; recompute and save-on-cpu are PyTorch's baselines, finer recomputes only (per "
        "block kept, recomputed selectively or whole), hybrid swaps or recomputes",
    )
    gpu_memory_bytes: int | None = option(
        None,
        parse=parse_bytes,
        metavar="SIZE",
        help="memory budget per GPU, e.g. 16GiB (default: the topology's)",
    )
    footprint_ratio: float | None = option(
        None,
        metavar="R",
        help="the budget is the no-swap peak divided by R: 1.5 plans for a GPU with two "
        "thirds of the memory training would take without swapping",
    )
    time_limit_s: float = option(
        60.0, metavar="S", help="time limit of the mip and auto policies, in seconds"
    )
    whole_blocks: bool = option(
        False,
        help="recompute whole blocks only (torch.utils.checkpoint's way); by default a "
        "recomputed block may keep its matmuls' and attention's outputs and re-run only its "
        "cheap operations, where that frees memory for less time",
    )
    bucket_bytes: int = option(
        DEFAULT_BUCKET_BYTES,
        parse=parse_bytes,
        metavar="SIZE",
        help="gradient all-reduce bucket size (DDP's bucket_cap_mb)",
    )

    def __post_init__(self) -> None:
        policy_kind(self.policy)
        require(
            self.gpu_memory_bytes is None or self.footprint_ratio is None,
            "give {gpu_memory_bytes} or {footprint_ratio}, not both",
        )
        require(
            self.footprint_ratio is None
            or (math.isfinite(self.footprint_ratio) and self.footprint_ratio >= 1),
            f"{{footprint_ratio}} is {self.footprint_ratio}; use a ratio >= 1 (1.5: the budget "
            "is two thirds of the no-swap peak)",
        )
        require(
            math.isfinite(self.time_limit_s) and self.time_limit_s > 0,
            f"{{time_limit_s}} is {self.time_limit_s}; use a positive finite number of seconds",
        )
        require(
            self.bucket_bytes > 0,
            f"{{bucket_bytes}} is {self.bucket_bytes} bytes; use a positive size such as 25MiB",
        )
