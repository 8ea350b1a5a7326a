"""PipelineConfig: how a model is cut into stages and scheduled, declared and checked once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError, option, require
from pipeswap.schedule.kinds import SCHEDULE_NAMES, ScheduleKind, schedule_kind
from pipeswap.schedule.modes import (
    NESTEROV_DELAY_LR_POWER,
    NESTEROV_SGD_DELAY_LR_POWER,
    PREDICTION_DELAY_LR_POWER,
    WEIGHT_MODES,
    weight_mode,
)
from pipeswap.units import parse_bytes

__all__ = ["DISTANCE_RULES", "PipelineConfig", "read_balance"]

DISTANCE_RULES = ("schedule", "official")


def read_balance(text: str) -> tuple[int, ...]:
    """The layer counts of a balance written ``3,3,2,2`` (checked against a model later)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"{{balance}} {text!r}: write layer counts like 3,3,2,2") from None


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism: stages, schedule, weight versions, and one-process emulation.

    Give ``stages`` (the partitioner balances them) or ``balance`` (layers per stage), or
    both when they agree. ``micro_batches`` None takes the schedule's default: one per
    stage for gpipe, 1f1b and 2bw, 1 for async-1f1b (which pipelines whole mini-batches).
    ``distances`` picks the version distances of ``spectrain`` / ``predict-adam``: walked
    from the schedule, or the official SpecTrain table (pipeswap.pipeline.predict).
    ``replicas`` D > 1 runs D copies of the pipeline side by side (pipeline x data
    parallel, D x K ranks): replica d trains on batch ``step * D + d`` of the data, and each
    stage averages its gradients over the replicas after the backward that completes them.
    ``weights="nesterov"`` is the Nesterov method of Ajanthan et al. (arXiv 2505.01099) as
    released, or its SGD form with an SGD optimizer (pipeswap.pipeline.weights).
    """

    stages: int | None = option(None, metavar="K", help="cut the model into K stages")
    balance: tuple[int, ...] | None = option(
        None,
        parse=read_balance,
        help="layers per stage, e.g. 3,3,2,2 (default: the partitioner's)",
    )
    schedule: str = option("1f1b", choices=SCHEDULE_NAMES, help="the pipeline schedule")
    weights: str = option(
        "stale",
        choices=tuple(WEIGHT_MODES),
        help="weight versions each pass sees on asynchronous schedules",
    )
    distances: str = option(
        "schedule",
        choices=DISTANCE_RULES,
        help="version distances for spectrain and predict-adam: walked from the schedule, or "
        "the official SpecTrain table",
    )
    micro_batches: int | None = option(
        None, help="units per mini-batch (default: one per stage; async-1f1b: 1)"
    )
    memory_cap_bytes: int | None = option(
        None,
        parse=parse_bytes,
        metavar="SIZE",
        help="per-stage memory cap for the partitioner, e.g. 8GiB (needs {profile_path})",
    )
    replicas: int = option(
        1,
        metavar="D",
        help="data-parallel replicas of the pipeline: D x stages ranks, each replica training "
        "on its own {batch} of every step, each stage's gradients averaged across the "
        "replicas before its update (default: {nproc} / stages)",
    )
    delay_lr_power: float | None = option(
        None,
        metavar="P",
        help="the stability rule of asynchronous schedules: a stage whose gradients arrive "
        "tau updates late (tau walked from the schedule: N-1-k on stage k of async-1f1b, 1 "
        "on 2bw) steps at lr / (1 + tau)^P, and a stage's gradient whose norm is above the "
        "mean + 2.5 std of its recent ones is scaled down to that bound "
        f"(default: P = {PREDICTION_DELAY_LR_POWER:g} for spectrain and predict-adam, "
        f"{NESTEROV_DELAY_LR_POWER:g} for nesterov ({NESTEROV_SGD_DELAY_LR_POWER:g} with sgd), the modes pipeswap recommends, which do "
        "not diverge where 1f1b converges with it; 0, both off, for the others; synchronous "
        "schedules have tau = 0)",
    )
    emulate: bool = option(False, help="run every stage in this process (bit-identical on CPU)")

    def __post_init__(self) -> None:
        require(
            self.stages is not None or self.balance is not None,
            "a pipeline needs {stages} (the number of stages) or {balance}",
        )
        require(
            self.stages is None or self.stages >= 1,
            f"{{stages}} is {self.stages}; cut the model into 1 or more stages",
        )
        if self.balance is not None:
            text = ",".join(map(str, self.balance))
            require(
                self.stages is None or len(self.balance) == self.stages,
                f"{{balance}} {text} has {len(self.balance)} stages but {{stages}} is "
                f"{self.stages}",
            )
            require(
                all(count >= 1 for count in self.balance),
                f"{{balance}} {text}: every stage needs at least one layer",
            )
        kind = schedule_kind(self.schedule)
        mode = weight_mode(self.weights)
        require(
            self.distances in DISTANCE_RULES,
            f"unknown {{distances}} {self.distances!r}; valid: " + ", ".join(DISTANCE_RULES),
        )
        require(
            self.micro_batches is None or self.micro_batches >= 1,
            f"{{micro_batches}} is {self.micro_batches}; use 1 or more",
        )
        kind.check_micro_batches(self.micro_batches)
        require(
            self.replicas >= 1,
            f"{{replicas}} is {self.replicas}; use 1 (one pipeline) or more",
        )
        require(
            self.delay_lr_power is None
            or (math.isfinite(self.delay_lr_power) and self.delay_lr_power >= 0),
            f"{{delay_lr_power}} is {self.delay_lr_power}; use 0 (off) or more",
        )
        require(
            mode.live or kind.asynchronous,
            f"{{weights}} {self.weights} chooses the weight versions of a schedule with no "
            f"flush, but {{schedule}} {self.schedule} is synchronous (every pass runs on the "
            "weights of its own update, so nothing is stale): use {schedule} async-1f1b, or "
            "drop {weights}",
        )

    def delay_power(self, optimizer: str | None = None) -> float:
        """P of the delay-scaled learning rate: ``delay_lr_power``, or the weight mode's
        default with the optimizer named ``optimizer`` (its entry's: 0 unless pipeswap
        recommends the mode)."""
        if self.delay_lr_power is not None:
            return self.delay_lr_power
        return weight_mode(self.weights).default_delay_lr_power(optimizer)

    @property
    def stability_rule(self) -> bool:
        """Whether the stages of this run keep the stability rule: an asynchronous schedule
        with the delay-scaled rate on (P > 0), and with it each stage's spike guard
        (pipeswap.pipeline.spike_guard)."""
        return self.asynchronous and self.delay_power() > 0

    @property
    def num_stages(self) -> int:
        if self.balance is not None:
            return len(self.balance)
        assert self.stages is not None
        return self.stages

    @property
    def num_ranks(self) -> int:
        """Processes of a run: one per stage of every replica."""
        return self.num_stages * self.replicas

    @property
    def schedule_kind(self) -> ScheduleKind:
        """The table entry of ``schedule`` (pipeswap.schedule.kinds)."""
        return schedule_kind(self.schedule)

    @property
    def asynchronous(self) -> bool:
        """True for schedules with no flush, whose stages take delayed gradients."""
        return self.schedule_kind.asynchronous

    @property
    def micro_batch_count(self) -> int:
        """Units per mini-batch: ``micro_batches``, or the schedule's default."""
        if self.micro_batches is not None:
            return self.micro_batches
        return self.schedule_kind.default_micro_batches(self.num_stages)

    @property
    def stage_balance(self) -> tuple[int, ...]:
        """Layers per stage of a resolved config (the partitioner's when none was given)."""
        require(
            self.balance is not None,
            "this pipeline has no {balance} yet: pipeswap.train (or "
            "pipeswap.pipeline.resolve_pipeline) finds one with the partitioner",
        )
        assert self.balance is not None
        return self.balance
