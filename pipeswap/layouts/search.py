"""The layout planner: every family on one server and budget, each simulated, fastest first.

Families: data parallel with swapping and recomputation (the swap planner's
``hybrid`` by default), pure pipelines (stages, balance, micro-batches, schedule),
pipelines whose stages swap (coordinated and uncoordinated), and pipelines replicated
by data parallelism (K stages x D replicas = the server's GPUs, with or without
swapping). Every layout moves the same samples per step as data parallelism at the
profile's batch on every GPU (``N * batch``): a replica's mini-batch is
``K * batch``, cut into micro-batches; ``async-1f1b`` pipelines whole mini-batches of
``K * batch`` or ``batch`` samples.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError
from pipeswap.hardware.topology import Topology
from pipeswap.layouts.evaluate import Scored, score_data_parallel, score_pipeline
from pipeswap.layouts.layout import FAMILIES, FAMILY_TITLES
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import SCHEDULE_NAMES, schedule_kind
from pipeswap.schedule.partition import partition
from pipeswap.schedule.timetable import Schedule, build_schedule
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.plan.stage_costs import StageCosts, stage_costs
from pipeswap.swap.plan.stage_mapping import Placement, replica_major, stage_major
from pipeswap.swap.plan.stage_plans import plan_stages
from pipeswap.swap.plan.stage_swap import NO_PLAN, StagePlan, floor_bytes, peak_bytes, stage_order
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.units import format_bytes

__all__ = ["LayoutSearch", "SearchSpace", "family_summary", "search_layouts"]


@dataclass(frozen=True)
class SearchSpace:
    """What the planner tries. ``micro_factors``: micro-batches per replica mini-batch as
    multiples of the stage count; ``stages``: pipeline depths (default every divisor of the
    GPU count from 2 up); ``steps``: mini-batches simulated (the rate is read over the
    middle half: :func:`pipeswap.layouts.evaluate.steady_rate_s`), per stage for
    ``async-1f1b``."""

    schedules: tuple[str, ...] = SCHEDULE_NAMES
    micro_factors: tuple[int, ...] = (1, 2, 4)
    stages: tuple[int, ...] | None = None
    dp_policies: tuple[str, ...] = ("hybrid",)
    steps: int = 8


@dataclass(frozen=True)
class LayoutSearch:
    """Every layout that fits, fastest first, and the smallest budget any would need."""

    scored: tuple[Scored, ...]
    smallest_bytes: int

    @property
    def best(self) -> Scored:
        return self.scored[0]

    def best_of(self, family: str, *, coordinated: bool | None = None) -> Scored | None:
        """The fastest of ``family`` (of its coordinated or uncoordinated layouts if asked)."""
        for s in self.scored:
            if s.layout.family == family and coordinated in (None, s.layout.coordinated):
                return s
        return None

    def best_swapping(self, *, coordinated: bool) -> Scored | None:
        """The fastest pipeline whose stages swap or recompute, with or without replicas,
        whose stages were planned coordinated (or not)."""
        for s in self.scored:
            if s.layout.swaps and s.layout.coordinated == coordinated:
                return s
        return None


def search_layouts(
    profile: Profile, topology: Topology, budget_bytes: int, space: SearchSpace = SearchSpace()
) -> LayoutSearch:
    """Search every family for ``profile`` (taken at one data-parallel GPU's batch) on all
    GPUs of ``topology`` within ``budget_bytes`` per GPU. Raises ConfigError naming the
    smallest budget that works when nothing fits."""
    gpus = topology.require_gpus()
    found: list[Scored] = []
    floors: list[int] = [workload_from_profile(profile).min_budget_bytes()]
    found.extend(_data_parallel(profile, topology, budget_bytes, space))
    for k in space.stages or [d for d in range(2, len(gpus) + 1) if len(gpus) % d == 0]:
        if k > len(profile.layers):
            continue
        for scored, floor in _pipelines(profile, topology, gpus, budget_bytes, k, space):
            floors.append(floor)
            if scored is not None:
                found.append(scored)
    smallest = min(floors)
    if not found:
        raise ConfigError(
            f"no layout of {profile.model} (batch {profile.batch} per GPU) fits "
            f"{{gpu_memory_bytes}} {budget_bytes} bytes ({format_bytes(budget_bytes)}) per GPU "
            f"on {topology.name}; the smallest budget that works is about {smallest} bytes "
            f"({format_bytes(smallest)}): give {{gpu_memory_bytes}} {smallest} or more, or a "
            "smaller batch"
        )
    found.sort(key=lambda s: (-s.layout.samples_per_s, s.layout.peak_bytes))
    return LayoutSearch(tuple(found), smallest)


def _data_parallel(
    profile: Profile, topology: Topology, budget_bytes: int, space: SearchSpace
) -> Iterator[Scored]:
    for policy in space.dp_policies:
        try:
            plan = make_plan(profile, topology, policy=policy, gpu_memory_bytes=budget_bytes)
        except ConfigError:
            return  # the budget is below what data parallelism can never swap
        if plan.fits:
            yield score_data_parallel(plan, profile, topology)


@dataclass(frozen=True)
class _Cut:
    """One pipeline candidate before placement and plans: a replica's mini-batch
    (``profile``) cut at ``balance`` and run by ``schedule`` on ``replicas`` rows of
    ``gpus``."""

    batch: int
    profile: Profile
    topology: Topology
    gpus: tuple[str, ...]
    budget_bytes: int
    schedule: Schedule
    weights: str
    balance: tuple[int, ...]
    replicas: int

    @property
    def costs(self) -> tuple[StageCosts, ...]:
        name, micro = self.schedule.name, self.schedule.micro_batches
        return stage_costs(
            self.profile, self.balance, schedule=name, micro_batches=micro, weights=self.weights
        )

    def score(
        self, placement: Placement, plans: Sequence[StagePlan], mapping: str, coordinated: bool
    ) -> Scored | None:
        return score_pipeline(
            self.profile,
            self.topology,
            self.budget_bytes,
            self.schedule,
            self.weights,
            self.costs,
            self.balance,
            placement,
            plans,
            mapping=mapping,
            coordinated=coordinated,
            batch=self.batch,
        )


def _pipelines(
    profile: Profile,
    topology: Topology,
    gpus: Sequence[str],
    budget_bytes: int,
    k: int,
    space: SearchSpace,
) -> Iterator[tuple[Scored | None, int]]:
    """Each K-stage candidate (with D = GPUs / K replicas), and the smallest budget its
    stages could be planned for."""
    replicas = len(gpus) // k
    used = tuple(gpus[: k * replicas])
    for name in space.schedules:
        # The weight mode it runs with: its extra weight copies count in memory.
        weights = schedule_kind(name).default_weights
        for unit_profile, micro, steps in _units(profile, k, name, space):
            schedule = build_schedule(name, k, steps, micro)
            for balance in _balances(unit_profile, k, name, micro, weights, budget_bytes):
                cut = _Cut(
                    profile.batch,
                    unit_profile,
                    topology,
                    used,
                    budget_bytes,
                    schedule,
                    weights,
                    balance,
                    replicas,
                )
                yield from _layouts_of(cut)


def _units(
    profile: Profile, k: int, name: str, space: SearchSpace
) -> list[tuple[Profile, int, int]]:
    """(a replica's mini-batch, micro-batches, steps) for schedule ``name`` on K stages:
    K times the per-GPU batch cut into micro-batches; ``async-1f1b`` pipelines whole
    mini-batches of K times the batch or of the batch itself."""
    if schedule_kind(name).takes_micro_batches:
        replica = profile.scaled(k)
        micro = [f * k for f in space.micro_factors if replica.batch % (f * k) == 0]
        return [(replica, m, space.steps) for m in micro]
    sizes = [profile.scaled(k)] + ([profile] if k > 1 else [])
    return [(p, 1, space.steps * k // 2) for p in sizes]


def _balances(
    profile: Profile, k: int, name: str, micro: int, weights: str, budget_bytes: int
) -> list[tuple[int, ...]]:
    """The partitioner's fastest cut, and its fastest cut within the budget if different."""

    def cut(cap: int | None) -> tuple[int, ...]:
        return partition(
            profile, k, memory_cap_bytes=cap, schedule=name, micro_batches=micro, weights=weights
        ).balance

    cuts = {cut(None)}
    try:
        cuts.add(cut(budget_bytes))
    except ConfigError:
        pass  # no cut fits without swapping
    return sorted(cuts)


def _layouts_of(cut: _Cut) -> Iterator[tuple[Scored | None, int]]:
    """The cut without swapping when it fits (in order, and stage by stage with
    replicas), else with coordinated and uncoordinated stage plans."""
    costs = cut.costs
    k = cut.schedule.num_stages
    # Plans are made on half the steps: a stage's memory repeats once the pipeline is
    # full, and the simulation of every step checks them.
    planning = build_schedule(
        cut.schedule.name, k, max(2, cut.schedule.num_steps // 2), cut.schedule.micro_batches
    )
    orders = [stage_order(planning, s) for s in range(k)]
    floor = max(floor_bytes(o, c) for o, c in zip(orders, costs))
    in_order = replica_major(cut.gpus, k, cut.replicas)
    if all(peak_bytes(o, c, NO_PLAN) <= cut.budget_bytes for o, c in zip(orders, costs)):
        yield cut.score(in_order, [NO_PLAN] * k, "sequential", False), floor
        if cut.replicas > 1:
            by_stage = stage_major(cut.gpus, k, cut.replicas)
            yield cut.score(by_stage, [NO_PLAN] * k, "stage-major", False), floor
        return
    for coordinated in (True, False):
        planned = plan_stages(
            cut.topology,
            cut.gpus,
            planning,
            costs,
            orders,
            cut.budget_bytes,
            replicas=cut.replicas,
            coordinated=coordinated,
        )
        if planned is None:
            yield None, floor
            continue
        plans, placement = planned
        yield cut.score(placement, plans, "cross" if coordinated else "mobius", coordinated), floor
        if coordinated:
            # The mapping search is an estimate: the plans in topology order are tried too.
            yield cut.score(in_order, plans, "sequential", True), floor


def family_summary(search: LayoutSearch) -> list[tuple[str, Scored | None]]:
    """The fastest layout of each family (None: none fits), with the family's title."""
    return [(FAMILY_TITLES[f], search.best_of(f)) for f in FAMILIES]
