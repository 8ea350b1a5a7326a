"""Plain single-process training in which each layer applies its gradient some updates late."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeswap.dist.group import single_threaded
from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel, evaluating
from pipeswap.pipeline.job import BatchSource, build_full_model, build_meta_model
from pipeswap.pipeline.predict import version_distances
from pipeswap.pipeline.rng import EVAL, TRAIN, rng_stream
from pipeswap.pipeline.shared import find_shared
from pipeswap.precision import autocast
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.schedule.timetable import Schedule, build_schedule
from pipeswap.train_config import TrainConfig

__all__ = ["DelayedResult", "schedule_delays", "train_with_delays"]


@dataclass(frozen=True)
class DelayedResult:
    """Per-step training losses and the held-out score of a :func:`train_with_delays` run.

    ``eval`` has the keys of ``PipelineResult.eval``: ``batches``, ``loss`` (when
    ``eval_batches`` > 0) and ``accuracy`` (image models).
    """

    config: TrainConfig
    delays: tuple[float, ...]
    losses: tuple[float, ...]
    eval: dict[str, float | int]
    wall_s: float


def schedule_delays(config: TrainConfig) -> tuple[int, ...]:
    """The per-layer delays under which :func:`train_with_delays` reproduces ``config``'s pipeline.

    Version v of a stage is its weights after v updates, and the update of mini-batch t
    is its (t+1)-th. A pass that :func:`~pipeswap.pipeline.predict.version_distances`
    gives distance ``s`` runs on version ``t - s``. With ``stash`` the backward reuses
    the forward's version, so stage k's gradient of mini-batch t is taken at version
    ``t - s_F``; that is a delay when ``s_F = min(t, d_k)`` for one ``d_k`` (in steady
    state on ``async-1f1b``: ``d_k = N - k - 1``, the warm-up clamps at version 0).
    ``d_k`` is the steady-state value even when ``config.steps`` is too short to reach
    it (a run that short cannot tell them apart). Synchronous schedules give 0
    everywhere in every weight mode. Weight modes that mix versions (``stale``: backward
    on newer weights than the forward) or predict them (``spectrain``, ``predict-adam``
    with ``s > 0``) are no delay, and raise. So does a parameter tied across stages on a
    schedule with delays: its copies apply their updates when the schedule lets them
    (:mod:`pipeswap.pipeline.shared`), not at any one layer's delay.
    """
    pipeline = config.require_pipeline()
    n, m = pipeline.num_stages, pipeline.micro_batch_count
    schedule = build_schedule(pipeline.schedule, n, config.steps, m)
    tied = find_shared(build_meta_model(config), pipeline.stage_balance)
    # Every stage reaches its steady state within N mini-batches.
    steady = build_schedule(pipeline.schedule, n, config.steps + n, m)
    out: list[int] = []
    for stage, layers in enumerate(pipeline.stage_balance):
        late = _gradient_delays(pipeline, schedule, stage)
        d = max(_gradient_delays(pipeline, steady, stage).values(), default=0)
        for unit, s in late.items():
            step = schedule.step_of(unit)
            if s != min(step, d):
                raise PipeswapError(
                    f"{pipeline.schedule}: stage {stage} takes the gradient of mini-batch {step} "
                    f"{s} updates late, not min({step}, {d}): no constant delay reproduces it"
                )
        out.extend([d] * layers)
    if tied and any(out):
        raise PipeswapError(
            f"{config.model} ties {tied[0].name} across stages {list(tied[0].holders)}: on "
            f"{pipeline.schedule} its copies apply their updates when the schedule lets them, "
            "not at one layer's delay, so no per-layer delays reproduce the pipeline; "
            "compare with the emulator instead, or use a synchronous schedule"
        )
    return tuple(out)


def _gradient_delays(pipeline: PipelineConfig, schedule: Schedule, stage: int) -> dict[int, int]:
    """unit -> how many updates late ``stage`` takes its gradient; raises for non-delays."""
    # The versions a pass runs on do not depend on the prediction rule: walk them.
    walked = version_distances(schedule, stage, "schedule")
    used = version_distances(schedule, stage, pipeline.distances)
    mode = weight_mode(pipeline.weights)
    late: dict[int, int] = {}
    for unit in range(schedule.num_units):
        forward, backward = (ActionKind.F, unit), (ActionKind.B, unit)
        late[unit] = mode.gradient_delay(
            pipeline.schedule,
            stage,
            unit,
            walked=(walked[forward], walked[backward]),
            used=(used[forward], used[backward]),
        )
    return late


def train_with_delays(config: TrainConfig, delays: Sequence[float]) -> DelayedResult:
    """Train ``config``'s model in one process; layer i takes its gradient ``delays[i]`` late.

    Version v is the weights after v updates. Update t (of mini-batch t) is applied to
    the live weights, version t, with the gradient computed at the point where layer i
    has version ``max(0, t - d_i)``, ``d_i = delays[i]``; a fractional ``d_i``
    interpolates linearly between versions ``t - floor(d_i)`` and ``t - ceil(d_i)``.
    All delays 0 is plain training: the same mathematics as a synchronous pipeline.
    Layers that share a parameter (tied embeddings) must have the same delay.

    Everything else is the emulator's: the model (``build_full_model``), the batches
    and micro-batches (``BatchSource``, loss scaled by 1/micro_batches), the optimizer
    and its settings, the learning-rate warm-up, the held-out evaluation, and the RNG
    stream each stage's layers run under (the pipeline's balance says which layers form a
    stage, :mod:`pipeswap.pipeline.rng`), so dropout draws the emulator's masks. The config's
    ``schedule``, ``weights`` and ``distances`` are ignored: the delays replace them
    (:func:`schedule_delays` gives those of a pipeline).
    """
    pipeline = config.require_pipeline()
    delays = tuple(float(d) for d in delays)
    bad = [d for d in delays if not math.isfinite(d) or d < 0]
    if bad:
        raise PipeswapError(
            f"gradient delays must be finite and >= 0 (updates late), not {bad[0]!r}"
        )
    started = time.perf_counter()
    with single_threaded():
        model = build_full_model(config)
        if len(delays) != len(model):
            raise PipeswapError(
                f"{len(delays)} delays for {config.model}, which has {len(model)} layers "
                f"({', '.join(model.layer_names)}): give one delay per layer"
            )
        layers = [list(layer.parameters()) for layer in model]
        _check_tied_delays(model, layers, delays)
        # A tied parameter is one parameter here: the optimizer steps it once.
        params = list({id(p): p for group in layers for p in group}.values())
        stages = [model.stage(a, b) for a, b in stage_bounds(pipeline.stage_balance)]
        optimizer = config.optim.build(params, nesterov=weight_mode(pipeline.weights).nesterov)
        depth = math.ceil(max(delays, default=0.0))
        history: list[list[list[torch.Tensor]]] = []  # [version][layer][param], newest last
        data = BatchSource(config, model)
        m = pipeline.micro_batch_count
        losses = []
        for step in range(config.steps):
            live = [[p.detach().clone() for p in group] for group in layers]
            history = (history + [live])[-(depth + 1) :]
            _set_delayed(layers, history, delays)
            step_loss = 0.0
            for micro in range(m):
                x, y = data.micro(step, micro)
                with autocast(config.precision, "cpu"):
                    loss = model.loss(_forward(config, stages, x, TRAIN, step, micro), y)
                (loss / m).backward()
                step_loss += loss.item()
            losses.append(step_loss / m)
            with torch.no_grad():
                for group, versions in zip(layers, live):
                    for p, v in zip(group, versions):
                        p.copy_(v)
                        # The pipeline's stages step parameters without a gradient too.
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
            if config.optim.lr_varies:
                for param_group in optimizer.param_groups:
                    param_group["lr"] = config.optim.lr_at(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        evaluation = _evaluate(config, model, stages)
    return DelayedResult(config, delays, tuple(losses), evaluation, time.perf_counter() - started)


def _check_tied_delays(
    model: LayeredModel, layers: list[list[torch.nn.Parameter]], delays: tuple[float, ...]
) -> None:
    """Refuse a parameter shared by layers with different delays: it has one version."""
    first: dict[int, int] = {}
    for index, group in enumerate(layers):
        for p in group:
            other = first.setdefault(id(p), index)
            if delays[other] != delays[index]:
                names = model.layer_names
                raise PipeswapError(
                    f"layers {names[other]!r} and {names[index]!r} share a parameter but have "
                    f"delays {delays[other]:g} and {delays[index]:g}: give layers that share "
                    "parameters the same delay"
                )


def _forward(
    config: TrainConfig,
    stages: list[torch.nn.Sequential],
    x: torch.Tensor,
    split: str,
    step: int,
    micro: int,
) -> torch.Tensor:
    """The model's forward, each stage's layers under the stream the pipeline gives them."""
    value: Any = x
    for index, stage in enumerate(stages):
        with rng_stream(config.seed, split, step, micro, index):
            value = stage(value)
    return value


@torch.no_grad()
def _set_delayed(
    layers: list[list[torch.nn.Parameter]],
    history: list[list[list[torch.Tensor]]],
    delays: tuple[float, ...],
) -> None:
    """Put layer i at version ``t - delays[i]`` (clamped to the oldest version kept)."""
    newest = len(history) - 1
    for group, d, index in zip(layers, delays, range(len(layers))):
        low, high = math.floor(d), math.ceil(d)
        a = history[max(0, newest - low)][index]
        b = history[max(0, newest - high)][index]
        frac = d - low
        for p, va, vb in zip(group, a, b):
            p.copy_(va if high == low else (1 - frac) * va + frac * vb)


def _evaluate(
    config: TrainConfig, model: LayeredModel, stages: list[torch.nn.Sequential]
) -> dict[str, float | int]:
    """Held-out loss (and accuracy) over the emulator's units: mean loss per micro-batch."""
    held_out = BatchSource(config, model, "val")
    loss_sum, correct, samples, units = 0.0, 0, 0, 0
    pipeline = config.require_pipeline()
    for step in range(config.dataset.eval_batches):
        for micro in range(pipeline.micro_batch_count):
            x, y = held_out.micro(step, micro)
            with evaluating(model), autocast(config.precision, "cpu"):
                out = _forward(config, stages, x, EVAL, step, micro)
                loss_sum += model.loss(out, y).item()
            correct += int((out.argmax(-1) == y).sum().item())
            samples += int(y.shape[0])
            units += 1
    evaluation: dict[str, float | int] = {"batches": config.dataset.eval_batches}
    if units:
        evaluation["loss"] = loss_sum / units
        if model.task_entry.accuracy:
            evaluation["accuracy"] = correct / samples
    return evaluation
