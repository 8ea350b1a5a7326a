"""What the stages do together at the end of a step: clip by the global norm, score held-out data.

A stage's UPDATE(t) comes after its last backward of mini-batch t and every transfer of
it, so every stage can reach its UPDATE(t) without waiting for any other stage's
UPDATE(t): the stages may meet there (clipping: every stage's squared gradient norm;
held-out scoring: a forward through every stage with the weights of t + 1 updates)
without a deadlock, on every schedule (:func:`meeting_points_hold` checks it). A stage
that arrives first waits for the others: on an asynchronous schedule that costs the
overlap the missing flush gives, as long as clipping is on or at each scoring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.timetable import Schedule

__all__ = ["CLIP_EPS", "clip_scale", "meeting_points_hold", "step_loss"]

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
CLIP_EPS = 1e-6


def clip_scale(squared_norms: list[float], max_norm: float) -> float:
    """The factor every gradient of a step is multiplied by: ``max_norm / (norm + 1e-6)``
    at most 1, with ``norm`` the L2 norm over every stage (``squared_norms`` in stage
    order, summed in that order): ``torch.nn.utils.clip_grad_norm_``'s formula, in double
    precision where it reduces float32 norms, so weights clipped by it can differ from a
    plain loop's in their last bits (about 1e-8)."""
    total = math.sqrt(sum(squared_norms))
    return min(max_norm / (total + CLIP_EPS), 1.0)


def step_loss(losses: Mapping[int, float], step: int, micro_batches: int) -> float:
    """Mini-batch ``step``'s loss: the mean of its micro-batches' losses (last stage)."""
    return sum(losses[step * micro_batches + i] for i in range(micro_batches)) / micro_batches


def meeting_points_hold(schedule: Schedule) -> bool:
    """Whether the stages may all meet right before each UPDATE(t): every transfer a
    stage receives before its UPDATE(t) is sent before its sender's UPDATE(t)."""
    update_at = [
        {a.unit: i for i, a in enumerate(actions) if a.kind is ActionKind.UPDATE}
        for actions in schedule.actions
    ]
    sent_at: dict[tuple[ActionKind, int, int], int] = {}
    for stage, actions in enumerate(schedule.actions):
        for i, a in enumerate(actions):
            if a.kind.is_send:
                sent_at[(a.kind.direction, stage, a.unit)] = i
    for stage, actions in enumerate(schedule.actions):
        step = 0
        for a in actions:
            if a.kind is ActionKind.UPDATE:
                step = a.unit + 1
                continue
            if not a.kind.is_receive:
                continue
            src = a.kind.peer(stage)
            # Received before this stage's UPDATE(step): sent before the sender's.
            if (
                step < schedule.num_steps
                and sent_at[(a.kind.direction, src, a.unit)] > (update_at[src][step])
            ):
                return False
    return True
