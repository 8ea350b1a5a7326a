"""Parameters tied across stages: one copy per holding stage, one sequence of updates for all.

A LayeredModel may hold one ``nn.Parameter`` in blocks that land on different stages
(GPT-2 and BERT tie the token embedding with the output projection). Each stage that
holds it gets a copy of its own (:func:`stage_module`). The update of mini-batch ``t``
uses the sum of every holder's gradient of ``t``, added in holder order, so every copy
steps with the same gradient, learning rate and optimizer state and the copies stay
bitwise equal.

When does a copy apply update ``t``? Holder ``h`` applies it right before its first pass
(forward or backward) that comes after its own ``UPDATE(t)`` and that the schedule
already orders after every holder's last backward of ``t`` (through the activations and
gradients it passes between stages). That pass could not start earlier anyway, so waiting
for the other holders' gradients there adds no dependency to the schedule: no deadlock,
no stall, and the same point in the emulator and in every process. Updates with no such
pass are applied after the last action. On synchronous schedules every holder applies
update ``t`` before its first pass of ``t + 1``: plain training of the tied model. On
asynchronous ones a copy may apply updates a few stage updates late (the last stage on
``async-1f1b``); weight prediction then counts the missing updates too, so every copy
predicts the same target version (see :class:`pipeswap.pipeline.weights.StageWeights`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from pipeswap.pipeline.weights import StageWeights, squared_norm
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.timetable import Schedule, unit_time_order

__all__ = [
    "Exchange",
    "MailboxExchange",
    "SharePlan",
    "SharedParam",
    "TiedParameters",
    "combine",
    "find_shared",
    "plan_sharing",
    "stage_module",
]


@dataclass(frozen=True)
class SharedParam:
    """A parameter reachable from blocks of several stages: its model-level name and holders."""

    name: str
    holders: tuple[int, ...]


def find_shared(model: nn.Module, balance: tuple[int, ...]) -> list[SharedParam]:
    """Every parameter held by more than one stage, in ``named_parameters()`` order.

    Found by identity in the full model, which every rank builds the same way, so every
    rank finds the same names and holders.
    """
    blocks = list(model.children())
    stages_of: dict[int, set[int]] = {}
    for stage, (first, end) in enumerate(stage_bounds(balance)):
        for block in blocks[first:end]:
            for p in block.parameters():
                stages_of.setdefault(id(p), set()).add(stage)
    return [
        SharedParam(name, tuple(sorted(stages_of[id(p)])))
        for name, p in model.named_parameters()
        if len(stages_of.get(id(p), ())) > 1
    ]


def stage_module(
    model: nn.Module, first: int, end: int, shared: list[SharedParam]
) -> tuple[nn.Sequential, dict[str, nn.Parameter]]:
    """Blocks ``first..end-1``, with a copy of their own of each parameter shared across stages.

    Returns the stage and ``{model-level name: this stage's copy}``. Parameters and
    buffers not shared across stages stay those of ``model`` (no memory is copied).
    """
    stage: nn.Sequential = model.stage(first, end)  # type: ignore[operator]
    named = dict(model.named_parameters())
    tied = {id(named[s.name]): s.name for s in shared}
    held = {id(p) for p in stage.parameters()} & set(tied)
    if not held:
        return stage, {}
    # deepcopy with a memo that maps everything but the tied parameters to itself: the
    # stage's modules are new objects (a module reachable from two stages is copied too),
    # the tied parameters fresh copies, everything else the model's own tensors.
    memo: dict[int, Any] = {id(p): p for p in stage.parameters() if id(p) not in held}
    memo.update({id(b): b for b in stage.buffers()})
    own = copy.deepcopy(stage, memo)
    copies = {tied[id(p)]: memo[id(p)] for p in stage.parameters() if id(p) in held}
    return own, copies


@dataclass
class SharePlan:
    """When one group of shared parameters (same holders) moves, per holding stage.

    ``send_after[stage][i] = t``: action ``i`` is the stage's last backward of mini-batch
    ``t``, after which its gradient of ``t`` is complete and goes to the other holders.
    ``apply_at[stage][t]``: the action index before which update ``t`` is applied (the
    stage's action count: after its last action). ``update_at[stage][t]``: where the stage's
    own ``UPDATE(t)`` stands (a checkpoint after ``done`` steps cuts there, ``t = done - 1``).
    """

    holders: tuple[int, ...]
    send_after: dict[int, dict[int, int]] = field(default_factory=dict)
    apply_at: dict[int, list[int]] = field(default_factory=dict)
    update_at: dict[int, list[int]] = field(default_factory=dict)
    release: list[int] = field(default_factory=list)
    _before: dict[int, dict[int, list[int]]] = field(default_factory=dict)

    def before(self, stage: int, index: int) -> list[int]:
        """The updates ``stage`` applies right before its action ``index``, in order."""
        if stage not in self._before:
            by_index: dict[int, list[int]] = {}
            for t, at in enumerate(self.apply_at[stage]):
                by_index.setdefault(at, []).append(t)
            self._before[stage] = by_index
        return self._before[stage].get(index, [])

    def pending(self, stage: int, done: int) -> dict[int, list[int]]:
        """Per update ``t`` whose gradient ``stage`` computed before its cut after ``done``
        steps: the holders that apply ``t`` after their own cut (they need it from the
        checkpoint). Updates every holder applied before its cut are left out."""
        cuts = {h: self.update_at[h][done - 1] for h in self.holders}
        out: dict[int, list[int]] = {}
        for i, t in self.send_after[stage].items():
            late = [h for h in self.holders if self.apply_at[h][t] > cuts[h]]
            if i < cuts[stage] and late:
                out[t] = late
        return out


def plan_sharing(schedule: Schedule, holders: tuple[int, ...]) -> SharePlan:
    """Where each holder sends its gradients and applies each update (module docstring).

    "Ordered after" is the schedule's happens-before relation, tracked with vector
    clocks over a valid interleaving: a receive merges the clock of its send.
    """
    n = schedule.num_stages
    clocks = [[0] * n for _ in range(n)]
    # (direction, sending stage, unit) -> the sender's clock when it sent.
    at_send: dict[tuple[ActionKind, int, int], list[int]] = {}
    pass_clock: dict[tuple[int, int], list[int]] = {}
    for timed in unit_time_order(schedule):
        stage, index, action = timed.stage, timed.index, timed.action
        clock = clocks[stage]
        if action.kind.is_receive:
            sent = at_send[(action.kind.direction, action.kind.peer(stage), action.unit)]
            clock[:] = [max(a, b) for a, b in zip(clock, sent)]
        clock[stage] = index + 1
        if action.kind.is_send:
            at_send[(action.kind.direction, stage, action.unit)] = list(clock)
        elif action.kind.is_pass and stage in holders:
            pass_clock[(stage, index)] = list(clock)
    plan = SharePlan(holders)
    last_backward: dict[int, list[int]] = {}
    for h in holders:
        last = [0] * schedule.num_steps
        for i, action in enumerate(schedule.actions[h]):
            if action.kind is ActionKind.B:
                last[schedule.step_of(action.unit)] = i
        last_backward[h] = last
        plan.send_after[h] = {i: t for t, i in enumerate(last)}
    for h in holders:
        actions = schedule.actions[h]
        passes = [i for i, a in enumerate(actions) if a.kind.is_pass]
        updates = {a.unit: i for i, a in enumerate(actions) if a.kind is ActionKind.UPDATE}
        apply_at: list[int] = []
        j = 0
        for t in range(schedule.num_steps):
            while j < len(passes) and (
                passes[j] < updates[t]
                or any(
                    pass_clock[(h, passes[j])][g] <= last_backward[g][t] for g in holders if g != h
                )
            ):
                j += 1
            apply_at.append(passes[j] if j < len(passes) else len(actions))
        plan.apply_at[h] = apply_at
        plan.update_at[h] = [updates[t] for t in range(schedule.num_steps)]
    # Update t is no longer needed by any checkpoint once every holder applied it before
    # its cut after ``done`` steps: the first such ``done``, or never (steps + 1).
    done = 1
    for t in range(schedule.num_steps):
        done = max(done, t + 1)
        while done <= schedule.num_steps and any(
            plan.apply_at[h][t] > plan.update_at[h][done - 1] for h in holders
        ):
            done += 1
        plan.release.append(done)
    return plan


def combine(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the holders' gradients, added in holder order (the same on every rank)."""
    total = grads[0].clone()
    for grad in grads[1:]:
        total.add_(grad)
    return total


class Exchange(Protocol):
    """Moves one holder's gradients of a mini-batch to another holder of the same group."""

    def send(self, group: int, step: int, dst: int, tensors: list[torch.Tensor]) -> None: ...
    def take(
        self, group: int, step: int, src: int, like: list[torch.Tensor]
    ) -> list[torch.Tensor]: ...
    def finish(self, abandon: Collection[tuple[int, int, int]] = ()) -> None: ...


class MailboxExchange:
    """Gradients as copies through a dict shared by every stage of the emulator."""

    def __init__(self, stage: int, mailbox: dict[tuple[int, int, int, int], list[torch.Tensor]]):
        self.stage = stage
        self.mailbox = mailbox

    def send(self, group: int, step: int, dst: int, tensors: list[torch.Tensor]) -> None:
        self.mailbox[(group, step, self.stage, dst)] = [t.detach().clone() for t in tensors]

    def take(self, group: int, step: int, src: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.mailbox.pop((group, step, src, self.stage))

    def finish(self, abandon: Collection[tuple[int, int, int]] = ()) -> None:
        pass


class TiedParameters:
    """One stage's side of its tied parameters: send its gradients, apply the summed updates.

    ``shared`` lists the tied parameters this stage holds; those with the same holders
    form a group that moves together (:func:`plan_sharing`).
    """

    def __init__(
        self,
        stage: int,
        schedule: Schedule,
        shared: list[SharedParam],
        weights: StageWeights,
        exchange: Exchange,
    ) -> None:
        self.stage = stage
        self.weights = weights
        self.exchange = exchange
        by_holders: dict[tuple[int, ...], list[str]] = {}
        for param in shared:
            by_holders.setdefault(param.holders, []).append(param.name)
        self.groups = [
            (names, plan_sharing(schedule, holders)) for holders, names in by_holders.items()
        ]
        self._own: dict[tuple[int, int], list[torch.Tensor]] = {}
        # Every holder's gradients of (group, t), taken early for the global norm.
        self._taken: dict[tuple[int, int], list[list[torch.Tensor]]] = {}
        self.crossing: set[tuple[int, int, int]] = set()
        # Mini-batches before it are applied by every holder (apply_through).
        self.settled = 0

    def replan(self, schedule: Schedule) -> None:
        """Plan every group over ``schedule``, a longer or shorter form of the one so far
        with the same actions up to where the stages are (pipeswap.pipeline.horizon): a
        plan's choices there depend only on those actions, so they stay as they were."""
        self.groups = [(names, plan_sharing(schedule, plan.holders)) for names, plan in self.groups]

    def after_backward(self, index: int) -> None:
        """After action ``index`` (a backward): send the gradients it completed, if any."""
        for g, (names, plan) in enumerate(self.groups):
            t = plan.send_after[self.stage].get(index)
            if t is None:
                continue
            grads = [self.weights.shared_gradient(name) for name in names]
            self._own[(g, t)] = grads
            for h in plan.holders:
                if h != self.stage:
                    self.exchange.send(g, t, h, grads)

    def _parts(self, g: int, t: int) -> list[list[torch.Tensor]]:
        """Every holder's gradients of group ``g`` and mini-batch ``t``, in holder order."""
        if (g, t) in self._taken:
            return self._taken.pop((g, t))
        own = self._own[(g, t)]
        holders = self.groups[g][1].holders
        return [own if h == self.stage else self.exchange.take(g, t, h, own) for h in holders]

    def squared_norm(self, t: int) -> float:
        """The squared norm of the summed gradients of mini-batch ``t`` of the groups this
        stage is the first holder of (so each tied parameter counts once over the stages).
        Every holder has sent them by its UPDATE(t): call it there, before this stage's."""
        total = 0.0
        for g, (_, plan) in enumerate(self.groups):
            if plan.holders[0] == self.stage:
                parts = self._taken[(g, t)] = self._parts(g, t)
                total += sum(squared_norm(combine(list(grads))) for grads in zip(*parts))
        return total

    def before_pass(self, index: int) -> None:
        """Before action ``index``: apply the updates the plan puts there (mini-batch order)
        that :meth:`apply_through` has not applied already."""
        for g, (names, plan) in enumerate(self.groups):
            for t in plan.before(self.stage, index):
                if t >= self.weights.shared_applied[names[0]]:
                    self._apply(g, names, t)

    def apply_through(self, done: int) -> None:
        """Apply every update of mini-batches before ``done`` not applied yet, waiting for
        the other holders' gradients where they have not come.

        For a synchronous schedule between steps (pipeswap.Pipeline): every holder sends
        its gradients of a mini-batch within that mini-batch's step, so no wait is for a
        holder that waits in turn. The copies then hold the weights after the last step,
        where the plan would apply an update only before the next step's first pass: a
        held-out batch, the weights taken and the rate a user's scheduler sets between
        steps find them as a plain loop has them. Each holder does so at each step's end,
        so a checkpoint after ``done`` steps needs none of their gradients (:meth:`state`).
        """
        self.settled = max(self.settled, done)
        for g, (names, _) in enumerate(self.groups):
            for t in range(self.weights.shared_applied[names[0]], done):
                self._apply(g, names, t)

    def _apply(self, g: int, names: list[str], t: int) -> None:
        parts = self._parts(g, t)
        for k, name in enumerate(names):
            self.weights.apply_shared(name, combine([part[k] for part in parts]), t)

    def release(self, done: int) -> None:
        """Forget own gradients no holder needs any more (not even after a checkpoint)."""
        for g, (_, plan) in enumerate(self.groups):
            for key in [key for key in self._own if key[0] == g and plan.release[key[1]] <= done]:
                del self._own[key]

    def state(self, done: int) -> dict[tuple[int, int], list[torch.Tensor]]:
        """Own gradients some holder applies after its cut after ``done`` steps."""
        saved: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.crossing = set()
        for g, (_, plan) in enumerate(self.groups):
            for t, late in plan.pending(self.stage, done).items():
                if t < self.settled:
                    continue  # every holder applied it already
                saved[(g, t)] = self._own[(g, t)]
                self.crossing |= {(g, t, h) for h in late if h != self.stage}
        return saved

    def load_state(self, saved: dict[tuple[int, int], list[torch.Tensor]], done: int) -> None:
        """Continue after a checkpoint: keep the saved gradients, send them again where due
        (one not saved was applied by every holder before its cut: :meth:`apply_through`)."""
        self._own = dict(saved)
        for g, (_, plan) in enumerate(self.groups):
            pending = plan.pending(self.stage, done)
            for t in sorted(pending):
                for h in pending[t]:
                    if h != self.stage and (g, t) in self._own:
                        self.exchange.send(g, t, h, self._own[(g, t)])
