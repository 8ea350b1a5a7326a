"""Cut a model into contiguous stages that minimize the slowest stage (exact DP)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeswap.config_fields import ConfigError, require
from pipeswap.jsonio import check_format
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import schedule_kind
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.pipeline_config import PipelineConfig, read_balance

__all__ = [
    "PARTITION_FORMAT",
    "Partition",
    "check_balance",
    "check_stage_count",
    "describe",
    "extra_weight_copies",
    "in_flight_units",
    "parse_balance",
    "partition",
    "stage_bounds",
    "stage_memory_bytes",
]

PARTITION_FORMAT = "pipeswap.partition/1"


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` layer indices of every stage of ``balance`` (layers per stage)."""
    out, start = [], 0
    for count in balance:
        out.append((start, start + count))
        start += count
    return out


@dataclass(frozen=True)
class Partition:
    """``balance[k]`` layers on stage k, with each stage's compute time and memory."""

    balance: tuple[int, ...]
    stage_seconds: tuple[float, ...]
    stage_memory_bytes: tuple[int, ...]

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` layer indices of every stage."""
        return stage_bounds(self.balance)

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_seconds)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PARTITION_FORMAT,
            "balance": list(self.balance),
            "stage_seconds": list(self.stage_seconds),
            "stage_memory_bytes": list(self.stage_memory_bytes),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Partition:
        check_format(obj, PARTITION_FORMAT, "partition")
        return cls(
            tuple(int(b) for b in obj["balance"]),
            tuple(float(s) for s in obj["stage_seconds"]),
            tuple(int(m) for m in obj["stage_memory_bytes"]),
        )


def in_flight_units(schedule: str, num_stages: int, stage: int, micro_batches: int = 1) -> int:
    """How many units (micro- or mini-batches) keep activations on ``stage`` at once."""
    return schedule_kind(schedule).in_flight_units(num_stages, stage, micro_batches)


def extra_weight_copies(weights: str, in_flight: int, schedule: str) -> int:
    """Weight copies beyond the live one that mode ``weights`` keeps on ``schedule``
    with ``in_flight`` units (WeightMode.extra_weight_copies)."""
    return weight_mode(weights).extra_weight_copies(in_flight, schedule_kind(schedule))


def stage_memory_bytes(
    profile: Profile,
    start: int,
    stop: int,
    stage: int,
    num_stages: int,
    *,
    schedule: str = PipelineConfig.schedule,
    micro_batches: int = 1,
    weights: str = PipelineConfig.weights,
) -> int:
    """Weights, gradients, optimizer state, weight versions and in-flight activations.

    The profile is taken at the mini-batch size, so one unit holds 1/micro_batches of a
    layer's saved tensors; optimizer state is shared out in proportion to parameters.
    """
    layers = profile.layers[start:stop]
    params = sum(layer.param_bytes for layer in layers)
    saved = sum(layer.saved_bytes for layer in layers)
    return _memory_of(profile, params, saved, stage, num_stages, schedule, micro_batches, weights)


def _memory_of(
    profile: Profile,
    params: int,
    saved: int,
    stage: int,
    num_stages: int,
    schedule: str,
    micro_batches: int,
    weights: str,
) -> int:
    """:func:`stage_memory_bytes` of a stage with ``params`` and ``saved`` bytes."""
    optimizer = profile.optimizer_state_bytes * params // (profile.param_bytes or 1)
    in_flight = in_flight_units(schedule, num_stages, stage, micro_batches)
    versions = extra_weight_copies(weights, in_flight, schedule)
    activations = math.ceil(in_flight * saved / micro_batches)
    return (2 + versions) * params + optimizer + activations


def partition(
    profile: Profile,
    num_stages: int,
    *,
    memory_cap_bytes: int | None = None,
    schedule: str = PipelineConfig.schedule,
    micro_batches: int = 1,
    weights: str = PipelineConfig.weights,
) -> Partition:
    """The contiguous cut into ``num_stages`` stages with the smallest slowest-stage time.

    Exact dynamic programming over (stage, last layer): O(L^2 N). With a memory cap, only
    stages whose :func:`stage_memory_bytes` fit are allowed; if none fits, the error
    names the smallest cap that any partition could meet.
    """
    layers = profile.layers
    check_stage_count(len(layers), num_stages, profile.layer_names, profile.model)
    seconds = [layer.forward_s + layer.backward_s for layer in layers]
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)

    # Prefix sums make each stage's memory O(1): the DP asks for O(L^2 N) of them.
    params, saved = [0], [0]
    for layer in layers:
        params.append(params[-1] + layer.param_bytes)
        saved.append(saved[-1] + layer.saved_bytes)

    def memory(start: int, stop: int, stage: int) -> int:
        return _memory_of(
            profile,
            params[stop] - params[start],
            saved[stop] - saved[start],
            stage,
            num_stages,
            schedule,
            micro_batches,
            weights,
        )

    def time_cost(start: int, stop: int, stage: int) -> float | None:
        if memory_cap_bytes is not None and memory(start, stop, stage) > memory_cap_bytes:
            return None
        return prefix[stop] - prefix[start]

    balance = _min_max_cut(len(layers), num_stages, time_cost)
    if balance is None:
        smallest = _min_max_cut(len(layers), num_stages, lambda a, b, k: float(memory(a, b, k)))
        assert smallest is not None
        need = max(memory(a, b, k) for k, (a, b) in enumerate(stage_bounds(smallest)))
        raise ConfigError(
            f"no cut of {profile.model} into {num_stages} stages fits {{memory_cap_bytes}} "
            f"{memory_cap_bytes} bytes per stage under {schedule}/{weights}; the smallest "
            f"possible is {need} bytes (balance {','.join(map(str, smallest))}): raise the cap "
            "or add stages"
        )
    return describe(
        profile, balance, schedule=schedule, micro_batches=micro_batches, weights=weights
    )


def describe(
    profile: Profile,
    balance: tuple[int, ...],
    *,
    schedule: str = PipelineConfig.schedule,
    micro_batches: int = 1,
    weights: str = PipelineConfig.weights,
) -> Partition:
    """The :class:`Partition` of a given balance (e.g. one the user gave)."""
    bounds = stage_bounds(balance)
    n = len(balance)
    return Partition(
        balance=tuple(balance),
        stage_seconds=tuple(
            sum(la.forward_s + la.backward_s for la in profile.layers[a:b]) for a, b in bounds
        ),
        stage_memory_bytes=tuple(
            stage_memory_bytes(
                profile, a, b, k, n, schedule=schedule, micro_batches=micro_batches, weights=weights
            )
            for k, (a, b) in enumerate(bounds)
        ),
    )


def parse_balance(text: str, num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Read a balance written ``3,3,2,2`` and check it covers ``num_layers`` in ``num_stages``."""
    return check_balance(read_balance(text), num_layers, num_stages)


def check_balance(
    balance: tuple[int, ...],
    num_layers: int,
    num_stages: int,
    names: Sequence[str] = (),
) -> tuple[int, ...]:
    """``balance`` if it gives every one of ``num_stages`` stages layers and covers them
    all; a refusal lists the layers by ``names`` (the embedding and head count too)."""
    text = ",".join(map(str, balance))
    require(
        len(balance) == num_stages,
        f"{{balance}} {text} has {len(balance)} stages but {{stages}} is {num_stages}",
    )
    shown = [*names[:3], "...", *names[-2:]] if len(names) > 8 else list(names)
    listed = f": {', '.join(shown)}" if names else ""
    require(
        all(b >= 1 for b in balance) and sum(balance) == num_layers,
        f"{{balance}} {text}: every stage needs at least one layer and the counts must add "
        f"up to the model's {num_layers} layers (they add up to {sum(balance)}); it counts "
        f"every layer, the embedding and the head as well as the blocks{listed}",
    )
    return balance


def check_stage_count(num_layers: int, num_stages: int, names: list[str], model: str) -> None:
    """Refuse more stages than the model has layers, naming the layers."""
    require(
        num_layers >= num_stages,
        f"{model} has {num_layers} layers ({', '.join(names)}), fewer than the {num_stages} "
        f"stages asked for: use {{stages}} {num_layers} or fewer",
    )


def _min_max_cut(num_layers: int, num_stages: int, cost: Any) -> tuple[int, ...] | None:
    """Balance minimizing max over stages of ``cost(start, stop, stage)`` (None = infeasible)."""
    inf = math.inf
    # best[k][j]: smallest bottleneck placing layers [0, j) on stages 0..k-1.
    best = [[inf] * (num_layers + 1) for _ in range(num_stages + 1)]
    cut = [[-1] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        # Leave at least one layer for each later stage.
        for j in range(k, num_layers - (num_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == inf:
                    continue
                c = cost(i, j, k - 1)
                if c is None:
                    continue
                value = max(best[k - 1][i], c)
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    if best[num_stages][num_layers] == inf:
        return None
    balance, j = [], num_layers
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        balance.append(j - i)
        j = i
    return tuple(reversed(balance))
