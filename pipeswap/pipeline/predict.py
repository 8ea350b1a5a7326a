"""Weight prediction: version distances walked from a schedule, and the step direction.

SpecTrain predicts the weights a pass should see as ``W_hat = W - s * lr * d``, where ``d``
is the optimizer's smoothed step direction and ``s`` the number of updates the stage
will apply before the mini-batch's own gradient lands. We derive ``s`` by walking the
schedule: for a pass (F or B of unit u on stage k), ``s`` counts the UPDATE actions of
stage k strictly between the pass and UPDATE(step of u). With ``s`` updates predicted,
the weights are those a synchronous pipeline would use for that mini-batch: the version
just before its own update.

Compared with the official SpecTrain table for an N-stage async 1F1B pipeline (stage k
from 0: forward ``floor(k/2) + N - k - 1``, backward ``floor(k/2)``), the walk gives, in
steady state, forward ``N - k - 1`` and backward ``0``: every value is exactly
``floor(k/2)`` smaller. The table targets a different version: the weights when the
mini-batch's update has been applied by *every* stage. Its gradient reaches stage 0
last, k stages after stage k; with forward and backward of equal length a stage runs one
(F, B) pair per two ticks, so it applies floor(k/2) more updates while the gradient
travels from stage k to stage 0. Our target is per stage (the version this stage's own
update is applied to), which needs no timing assumption. In the warm-up (the first
N - k mini-batches of stage k) the walk also gives smaller forward distances, because
fewer updates precede the mini-batch's own: mini-batch u < N - k has forward s = u.

On ``2bw`` (PipeDream-2BW) the walk gives, at every stage whatever the depth, forward
``s = 1`` and backward ``s = 0`` for every micro-batch of mini-batch t >= 1 (mini-batch 0:
0 and 0): its forwards run between UPDATE(t - 2) and UPDATE(t - 1), its backwards after
UPDATE(t - 1) (the stage's one gradient buffer). So ``stash`` runs the backward on the
forward's version and the update is W(t+1) = W(t) - lr * grad(W(t-1)), the paper's
one-update delay; ``spectrain`` predicts one update ahead on the forward; ``stale`` runs
the backward on weights one update newer than its forward. ``build_schedule("2bw", ...,
delay=0)`` has no delay (every distance 0): the updates of synchronous gradient
accumulation, the same as ``1f1b`` (:func:`delay_free_schedule`).

``rule="official"`` (``PipelineConfig.distances``) uses the table instead: on ``async-1f1b``
every walked distance of stage k plus ``floor(k/2)`` (so exactly the table in steady state,
and the backward of stage k >= 2 is predicted too); synchronous schedules have no staleness
under either rule, and ``2bw`` (whose table is its walk) keeps the walked distances.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.pipeline_config import DISTANCE_RULES
from pipeswap.schedule.timetable import Schedule, build_schedule

__all__ = [
    "DIRECTED",
    "DISTANCE_RULES",
    "Distances",
    "delay_free_schedule",
    "delay_lr_scale",
    "group_of",
    "official_distances",
    "steady_distances",
    "step_direction",
    "version_distances",
]

# (kind, unit) -> s for every forward and backward of one stage. DISTANCE_RULES: how s is
# chosen, walked from the schedule (default) or the official SpecTrain table.
Distances = dict[tuple[ActionKind, int], int]


def version_distances(schedule: Schedule, stage: int, rule: str = "schedule") -> Distances:
    """``s`` for every F and B of ``stage``: UPDATEs strictly between the pass and its own.

    With ``rule="official"`` on an asynchronous schedule, ``floor(stage/2)`` more (the table).
    """
    if rule not in DISTANCE_RULES:
        raise ValueError(f"unknown distance rule {rule!r}; valid: {', '.join(DISTANCE_RULES)}")
    walked = _walked_distances(schedule, stage)
    if rule == "official" and schedule.kind.spectrain_table:
        return {key: s + stage // 2 for key, s in walked.items()}
    return walked


def _walked_distances(schedule: Schedule, stage: int) -> Distances:
    actions = schedule.compute_actions(stage)
    update_at = {a.unit: i for i, a in enumerate(actions) if a.kind is ActionKind.UPDATE}
    updates_before = []
    count = 0
    for action in actions:
        updates_before.append(count)
        count += action.kind is ActionKind.UPDATE
    distances: Distances = {}
    for i, action in enumerate(actions):
        if action.kind.is_pass:
            own = update_at[schedule.step_of(action.unit)]
            # Updates at positions i+1 .. own-1.
            distances[(action.kind, action.unit)] = updates_before[own] - updates_before[i + 1]
    return distances


def delay_free_schedule(schedule: Schedule) -> Schedule | None:
    """The same schedule with its delay disabled (every distance 0), or None if it has none.

    ``2bw`` with ``delay=0``: each mini-batch's forwards wait for the previous update, so
    training is synchronous gradient accumulation (the updates of ``1f1b``). Synchronous
    schedules are their own delay-free form; ``async-1f1b`` has none (its delay is the
    pipeline's depth). The entry's ``delay_free`` says which (ScheduleKind).
    """
    kind = schedule.kind
    if not kind.asynchronous:
        return schedule
    if kind.delay_free is None:
        return None
    return build_schedule(
        kind.name,
        schedule.num_stages,
        schedule.num_steps,
        schedule.micro_batches,
        delay=kind.delay_free,
    )


def steady_distances(schedule: Schedule, stage: int, rule: str = "schedule") -> tuple[int, int]:
    """The (forward, backward) distance most units of ``stage`` get (the steady state)."""
    distances = version_distances(schedule, stage, rule)
    result = []
    for kind in (ActionKind.F, ActionKind.B):
        values = Counter(s for (k, _), s in distances.items() if k == kind)
        result.append(max(values.items(), key=lambda kv: (kv[1], kv[0]))[0])
    return result[0], result[1]


def delay_lr_scale(schedule: Schedule, stage: int, power: float) -> float:
    """The factor on ``stage``'s learning rate of the delay-scaled rule: ``(1 + tau) ** -power``.

    ``tau`` is the delay of the stage's gradients, walked from the schedule: the steady
    forward distance (N - k - 1 on stage k of async-1f1b, 1 on 2bw, 0 on a synchronous
    schedule, whose rate is kept bit for bit). Delayed gradient descent on a quadratic is
    stable only for a rate that shrinks with the delay (``lr * h < 2 sin(pi / (4 tau + 2))``,
    about 1 / (1 + 2 tau) of the undelayed bound), and SGD with momentum tolerates much
    less: the stages whose gradients are most stale step least (Zhang et al., IJCAI 2016,
    divide by tau: ``power`` 1; each recommended mode's ``WeightMode.delay_lr_power`` is what
    pipeswap measured).
    """
    if power == 0:
        return 1.0
    tau = steady_distances(schedule, stage)[0]
    return float((1.0 + tau) ** -power)


def official_distances(num_stages: int, stage: int) -> tuple[int, int]:
    """The official SpecTrain table: (forward, backward) = (k//2 + N-k-1, k//2)."""
    return stage // 2 + num_stages - stage - 1, stage // 2


# The optimizers whose step direction is known (a weight mode that predicts needs one).
DIRECTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


@torch.no_grad()
def step_direction(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor | None:
    """The direction ``d`` the optimizer moves ``param`` along (its update is ``-lr * d``).

    SGD: the momentum buffer. Adam/AdamW: ``m_hat / (sqrt(v_hat) + eps)``, plus
    ``weight_decay * param`` for AdamW's decoupled decay. None before the first step.
    """
    state = optimizer.state.get(param)
    if not state:
        return None
    group = group_of(optimizer, param)
    if isinstance(optimizer, torch.optim.SGD):
        return state.get("momentum_buffer")
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        beta1, beta2 = group["betas"]
        step = float(state["step"])
        m_hat = state["exp_avg"] / (1 - beta1**step)
        v_hat = state["exp_avg_sq"] / (1 - beta2**step)
        direction = m_hat / (v_hat.sqrt() + group["eps"])
        if isinstance(optimizer, torch.optim.AdamW) and group["weight_decay"]:
            direction = direction + group["weight_decay"] * param
        return direction
    raise TypeError(f"no step direction for {type(optimizer).__name__}")


def group_of(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> dict[str, Any]:
    """The parameter group of ``optimizer`` that holds ``param`` (its rate, its decay)."""
    return next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
