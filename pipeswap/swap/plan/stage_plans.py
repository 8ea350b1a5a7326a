"""Swap plans for every stage of a layout: coordinated over shared switches, or each on its own.

Coordinated (as TMO coordinates data-parallel GPUs): stages are first mapped to GPUs so
that those copying at the same time sit under different switches
(:func:`pipeswap.swap.plan.stage_mapping.cross_mapping`); then the GPUs under one switch share
its bandwidth, each stage's share (max-min fair over what each would swap alone) is
what it may swap at no cost, and beyond it the stage recomputes layers where that is
cheaper than waiting for the link. Uncoordinated (Mobius-like): the Mobius mapping, and
every stage plans as if its PCIe path were its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeswap.hardware.topology import Topology
from pipeswap.schedule.timetable import Schedule
from pipeswap.swap.plan.channels import channel_groups, path_bytes_per_s
from pipeswap.swap.plan.stage_costs import StageCosts
from pipeswap.swap.plan.stage_mapping import (
    Placement,
    cross_mapping,
    mobius_mapping,
    transfer_windows,
)
from pipeswap.swap.plan.stage_swap import StageAction, StagePlan, plan_stage, unit_memory

__all__ = ["plan_stages", "water_fill"]


def water_fill(capacity: float, demands: Sequence[float]) -> list[float]:
    """Max-min fair shares of ``capacity``: nobody gets more than it asks, and what one
    leaves is shared equally by the others."""
    shares = [0.0] * len(demands)
    left = capacity
    waiting = sorted(range(len(demands)), key=lambda i: demands[i])
    while waiting:
        equal = left / len(waiting)
        i = waiting[0]
        if demands[i] <= equal:
            shares[i] = demands[i]
            left -= demands[i]
            waiting.pop(0)
        else:
            for j in waiting:
                shares[j] = equal
            break
    return shares


def plan_stages(
    topology: Topology,
    gpus: Sequence[str],
    schedule: Schedule,
    stages: Sequence[StageCosts],
    orders: Sequence[Sequence[StageAction]],
    budget_bytes: int,
    *,
    replicas: int,
    coordinated: bool,
    swap: bool = True,
    recompute: Sequence[bool] | None = None,
) -> tuple[list[StagePlan], Placement] | None:
    """Every stage's plan and the placement they were made for (None: some stage cannot
    fit the budget). ``gpus``: the layout's GPUs, ``replicas`` times ``len(stages)``.
    ``swap`` False plans recomputation only; ``recompute`` says per stage whether it may
    recompute (default: every stage)."""
    moves = (swap, [True] * len(stages) if recompute is None else list(recompute))
    bandwidth = min(path_bytes_per_s(topology, g) for g in gpus)
    # The pipeline runs one unit per period of its slowest stage: that long is what a
    # stage's copies of one unit may take without slowing it down.
    period = max(c.forward_s + c.backward_s for c in stages)
    alone = bandwidth * period
    if not coordinated:
        own = _plans(orders, stages, budget_bytes, [alone] * len(stages), bandwidth, moves)
        if own is None:
            return None
        return own, mobius_mapping(topology, gpus, len(stages), replicas)
    # What each stage would swap with the whole path to itself decides who copies when.
    greedy = _plans(orders, stages, budget_bytes, [alone] * len(stages), bandwidth, moves)
    if greedy is None:
        return None
    windows = transfer_windows(schedule, stages, greedy, bandwidth)
    units = schedule.num_units
    placement = cross_mapping(
        topology,
        gpus,
        stages,
        windows,
        replicas=replicas,
        units=units,
        steps=schedule.num_steps,
    )
    demand = [float(unit_memory(c, p).swap) for c, p in zip(stages, greedy)]
    allowance = [alone] * len(stages)
    stage_of = {gpu: k for row in placement for k, gpu in enumerate(row)}
    for group in channel_groups(topology, [g for row in placement for g in row]):
        members = [stage_of[g] for g in group]
        for k, share in zip(members, water_fill(alone, [demand[k] for k in members])):
            allowance[k] = min(allowance[k], share)
    shared = _plans(orders, stages, budget_bytes, allowance, bandwidth, moves)
    if shared is None:
        return None
    return shared, placement


def _plans(
    orders: Sequence[Sequence[StageAction]],
    stages: Sequence[StageCosts],
    budget_bytes: int,
    allowance: Sequence[float],
    bandwidth: float,
    moves: tuple[bool, Sequence[bool]],
) -> list[StagePlan] | None:
    swap, recompute = moves
    plans = []
    for order, c, free, may in zip(orders, stages, allowance, recompute):
        plan = plan_stage(
            order,
            c,
            budget_bytes,
            allowance_bytes=free,
            bytes_per_s=bandwidth,
            swap=swap,
            recompute=may,
        )
        if plan is None:
            return None
        plans.append(plan)
    return plans
