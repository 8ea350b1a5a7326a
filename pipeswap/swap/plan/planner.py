"""make_plan: profile + topology + budget + policy -> a scored SwapPlan and its task graph."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pipeswap.config_fields import ConfigError, require
from pipeswap.errors import PipeswapError, first_line
from pipeswap.hardware.topology import Topology
from pipeswap.profiling.profile import Profile
from pipeswap.sim.engine import OutOfMemoryError
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.swap.plan import GpuPlan, SwapPlan
from pipeswap.swap.plan.bounds import LowerBound, TurnBound, lower_bound, turn_bound
from pipeswap.swap.plan.budget import PROBE_S, naming_smallest, resolve_budget
from pipeswap.swap.plan.case import Case
from pipeswap.swap.plan.policies import fits as assignment_fits
from pipeswap.swap.plan.policies import need_bytes
from pipeswap.swap.plan.policy_table import Policy, policy_entry
from pipeswap.swap.plan.refused import BudgetRefused, never_recomputed
from pipeswap.swap.plan.scoring import Scored
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.units import format_bytes

__all__ = ["GpuSummary", "PlanResult", "make_case", "make_plan", "plan_case", "swap_config"]


@dataclass(frozen=True)
class GpuSummary:
    """What one GPU does under the plan, as simulated."""

    gpu: str
    peak_bytes: int
    budget_bytes: int
    swapped_bytes: int
    stall_s: float
    offset_s: float
    recomputed_layers: int = 0
    recompute_s: float = 0.0  # per micro-batch

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanResult:
    """A plan with the exact graph that was scored, its simulation and summary numbers.

    ``topology`` carries the budget as every GPU's memory: simulating ``graph`` on it
    (``pipeswap simulate --graph G --topology T --gpu-memory BUDGET``) gives
    ``iteration_s`` again (``simulated_memory_bytes`` says which memory). ``fits`` is False
    only for the baselines that ignore the budget (``none``, ``recompute``, ``save-on-cpu``)
    when their peak exceeds it; their graph is then scored without a memory limit.
    """

    policy: str
    plan: SwapPlan
    graph: TaskGraph
    result: SimResult
    topology: Topology
    budget_bytes: int
    iteration_s: float
    compute_s: float
    bound: LowerBound
    turn: TurnBound
    solve_s: float
    mip_gap: float | None
    fits: bool
    gpus: tuple[GpuSummary, ...]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def lower_bound_s(self) -> float:
        """design.md's bound: compute, or the bytes the busiest directed link must carry."""
        return self.bound.bound_s

    @property
    def turn_bound_s(self) -> float:
        """The turn bound (pipeswap.swap.plan.bounds): each GPU's bytes leave during its forward
        and come back during its backward, at most at its own path's bandwidth."""
        return self.turn.bound_s

    @property
    def bound_s(self) -> float:
        """The best lower bound known: the larger of the two."""
        return max(self.bound.bound_s, self.turn.bound_s)

    @property
    def gap_to_bound(self) -> float:
        """How far above design.md's lower bound the plan runs: iteration / bound - 1."""
        return self.iteration_s / self.bound.bound_s - 1.0

    @property
    def gap_to_best_bound(self) -> float:
        """How far above the best known bound (``bound_s``) the plan runs."""
        return self.iteration_s / self.bound_s - 1.0

    def runnable(self) -> PlanResult:
        """This plan, for a run to apply; refused where it does not fit its budget (a
        baseline's rule ignores it), naming the smallest budget its rule fits."""
        if self.fits:
            return self
        least = self.notes["least_bytes"]
        raise ConfigError(
            f"policy {self.policy} plans by its rule, and its plan cannot keep its budget: "
            f"{self.notes['failure'].removeprefix('does not fit: ')} by "
            f"{least - self.budget_bytes} bytes; "
            f"for it the smallest budget that works is {least} bytes ({format_bytes(least)}): "
            "give {gpu_memory_bytes} at least that, or a policy that plans for the budget "
            "(hybrid or auto)"
        )

    @property
    def simulated_memory_bytes(self) -> int:
        """The GPU memory that re-simulating ``graph`` on ``topology`` gives ``iteration_s``
        with: the budget, or 0 (no limit) for a baseline that does not fit it."""
        return self.budget_bytes if self.fits else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "fits": self.fits,
            "iteration_s": self.iteration_s,
            "compute_s": self.compute_s,
            "lower_bound_s": self.lower_bound_s,
            "turn_bound_s": self.turn_bound_s,
            "bound_s": self.bound_s,
            "gap_to_bound": self.gap_to_bound,
            "gap_to_best_bound": self.gap_to_best_bound,
            "bound_binding": self.bound.binding,
            "turn_bound_binding": self.turn.binding,
            "solve_s": self.solve_s,
            "mip_gap": self.mip_gap,
            "budget_bytes": self.budget_bytes,
            "gpus": [g.to_json() for g in self.gpus],
            "notes": self.notes,
        }


def _select_gpus(topology: Topology, gpus: int | Sequence[str] | None) -> tuple[str, ...]:
    """The data-parallel GPUs: all by default, the first N, or the named ones."""
    available = topology.gpus
    if gpus is None:
        return tuple(available)
    if isinstance(gpus, int):
        require(
            1 <= gpus <= len(available),
            f"{{gpus}} is {gpus}; topology {topology.name!r} has {len(available)} GPUs "
            f"({', '.join(available)}): use 1 to {len(available)}",
        )
        return tuple(available[:gpus])
    for gpu in gpus:
        if topology.node(gpu).kind != "gpu":
            raise PipeswapError(f"{gpu!r} is not a GPU of topology {topology.name!r}")
    return tuple(gpus)


def swap_config(config: SwapConfig | None, settings: dict[str, Any]) -> SwapConfig:
    """``config``, or one made of ``settings`` (SwapConfig's field names); not both."""
    if config is None:
        return SwapConfig(**settings)
    if settings:
        raise TypeError(f"pass a SwapConfig or its fields, not both (got {sorted(settings)})")
    return config


def make_case(
    profile: Profile,
    topology: Topology,
    config: SwapConfig | None = None,
    *,
    gpus: int | Sequence[str] | None = None,
    sync_every: int = 1,
    **settings: Any,
) -> Case:
    """The planning problem, with the budget checked and written into the topology.

    ``config`` holds the budget and the bucket size; or give those as keyword arguments
    (SwapConfig's field names). ``sync_every``: micro-batches per gradient all-reduce (a
    run's gradient accumulation, OptimizerConfig.accumulate).
    """
    config = swap_config(config, settings)
    workload = workload_from_profile(profile)
    if config.whole_blocks:  # no selective recomputation: its measurements are not offered
        workload = replace(workload, selective_kept=(), selective_rerun=(), selective_s=())
    chosen = _select_gpus(topology, gpus)
    budget = resolve_budget(workload, topology, chosen, config)
    return Case(
        workload=workload,
        topology=topology.with_gpu_memory(budget),
        gpus=chosen,
        budget_bytes=budget,
        sync_every=sync_every,
        bucket_bytes=config.bucket_bytes,
    )


def make_plan(
    profile: Profile,
    topology: Topology,
    config: SwapConfig | None = None,
    *,
    gpus: int | Sequence[str] | None = None,
    sync_every: int = 1,
    **settings: Any,
) -> PlanResult:
    """Plan one iteration of data-parallel training of ``profile`` on ``topology``, of
    ``sync_every`` micro-batches per GPU (gradient accumulation).

    ``config`` (or its fields as keyword arguments: ``policy="auto", footprint_ratio=1.5``)
    says the policy and the budget: ``gpu_memory_bytes``, the no-swap peak divided by
    ``footprint_ratio``, or else the topology's GPU memory.
    """
    config = swap_config(config, settings)

    def plans_at(budget: int) -> bool:
        at = replace(config, gpu_memory_bytes=budget, footprint_ratio=None)
        try:
            plan_case(
                make_case(profile, topology, at, gpus=gpus, sync_every=sync_every),
                profile,
                at.policy,
                time_limit_s=min(at.time_limit_s, PROBE_S),
            )
        except PipeswapError:  # no plan of the policy at that budget
            return False
        return True

    try:
        case = make_case(profile, topology, config, gpus=gpus, sync_every=sync_every)
        result = plan_case(case, profile, config.policy, time_limit_s=config.time_limit_s)
    except BudgetRefused as refused:  # named: the smallest budget the policy plans
        raise naming_smallest(refused, plans_at) from None
    if config.policy == "recompute" and result.fits and (held := never_recomputed(case.workload)):
        warnings.warn(f"pipeswap: with policy recompute, {held}", RuntimeWarning, stacklevel=2)
    return result


def plan_case(case: Case, profile: Profile, policy: str, *, time_limit_s: float) -> PlanResult:
    """Run ``policy`` on an already checked ``case``."""
    started = time.perf_counter()
    entry = policy_entry(policy)
    if not entry.respects_budget:
        return _score_unchecked(case, profile, entry, started)
    try:
        scored, notes, mip_gap = entry.plan(case, time_limit_s)
    except OutOfMemoryError as exc:
        # The smallest budget the planner accepts is a bound no plan can go below; this
        # policy's plans did not reach it.
        recomputes = "" if entry.recomputes else ", or a policy that also recomputes (hybrid)"
        if entry.recomputes and (held := never_recomputed(case.workload)):
            recomputes += f"; {held}"
        raise BudgetRefused(
            f"no plan of policy {policy} fits a budget of {case.budget_bytes} bytes "
            f"({format_bytes(case.budget_bytes)}): {first_line(exc)}; give a larger "
            f"{{gpu_memory_bytes}} (or a smaller {{footprint_ratio}}){recomputes}",
            floor=case.budget_bytes,
            peak=case.workload.no_swap_peak_bytes(),
            smallest=None,
        ) from None
    solve_s = time.perf_counter() - started
    return _summarize(case, profile, policy, scored, solve_s=solve_s, mip_gap=mip_gap, notes=notes)


def _score_unchecked(case: Case, profile: Profile, policy: Policy, started: float) -> PlanResult:
    assert policy.assign is not None, "a baseline that ignores the budget plans by rule"
    assignment = policy.assign(case)
    if assignment_fits(case, assignment):
        scored = case.score(assignment)
        return _summarize(case, profile, policy.name, scored, solve_s=time.perf_counter() - started)
    # It does not fit: score it without a limit so the table can still show its peak.
    unlimited = replace(case, topology=case.topology.with_gpu_memory(0))
    scored = unlimited.score(assignment)
    # What it needs with its copies waited for, as the runtime waits: its smallest budget.
    need = need_bytes(case, assignment)
    notes = {
        "failure": f"does not fit: {policy.peak} {need} bytes ({format_bytes(need)}) exceeds "
        f"the budget {case.budget_bytes} bytes ({format_bytes(case.budget_bytes)})"
        + (f" ({held})" if policy.recomputes and (held := never_recomputed(case.workload)) else ""),
        "least_bytes": need,
    }
    return _summarize(
        unlimited,
        profile,
        policy.name,
        scored,
        solve_s=time.perf_counter() - started,
        notes=notes,
        fits=False,
        budget_bytes=case.budget_bytes,
    )


def _summarize(
    case: Case,
    profile: Profile,
    policy: str,
    scored: Scored,
    *,
    solve_s: float,
    mip_gap: float | None = None,
    notes: dict[str, Any] | None = None,
    fits: bool = True,
    budget_bytes: int | None = None,
) -> PlanResult:
    """Package a scored assignment as a PlanResult with its SwapPlan."""
    budget = case.budget_bytes if budget_bytes is None else budget_bytes
    key = ("bounds", budget)
    if key not in case.memo:  # the bounds depend on the case only: one computation per case
        case.memo[key] = (
            lower_bound(
                case.workload, case.topology, case.gpus, budget, sync_every=case.sync_every
            ),
            turn_bound(
                case.workload,
                case.topology,
                case.gpus,
                budget,
                sync_every=case.sync_every,
                bucket_bytes=case.bucket_bytes,
            ),
        )
    bound, turn = case.memo[key]
    assignment = scored.assignment
    names = case.workload.names
    gpu_plans = []
    summaries = []
    for rank, gpu in enumerate(case.gpus):
        swaps = assignment.swaps.get(gpu, ())
        decisions = tuple(s.decision(names) for s in swaps)
        offset = float(assignment.offsets_s.get(gpu, 0.0))
        recomputed = sorted(assignment.recomputed(gpu))
        selective = tuple(names[i] for i in recomputed if i in assignment.selective)
        gpu_plans.append(
            GpuPlan(
                gpu,
                rank,
                budget,
                offset,
                decisions,
                tuple(names[i] for i in recomputed),
                selective,
            )
        )
        stats = scored.result.gpus[gpu]
        summaries.append(
            GpuSummary(
                gpu,
                stats.peak_bytes,
                budget,
                assignment.swapped_bytes(gpu),
                stats.stall_s,
                offset,
                len(recomputed),
                sum(case.workload.forward_s[i] for i in recomputed),
            )
        )
    iteration_s = scored.iteration_s
    plan = SwapPlan(
        policy=policy,
        model=profile.model,
        layers=names,
        gpus=tuple(gpu_plans),
        sync_every=case.sync_every,
        bucket_bytes=case.bucket_bytes,
        predicted_iteration_s=iteration_s,
        lower_bound_s=bound.bound_s,
        notes=dict(notes or {}),
        batch=profile.batch,
        dtype=profile.dtype,
        seq_len=profile.seq_len,
        image_size=profile.image_size,
        turn_bound_s=turn.bound_s,
    )
    return PlanResult(
        policy=policy,
        plan=plan,
        graph=scored.graph,
        result=scored.result,
        topology=case.topology,
        budget_bytes=budget,
        iteration_s=iteration_s,
        compute_s=case.workload.compute_s(case.sync_every),
        bound=bound,
        turn=turn,
        solve_s=solve_s,
        mip_gap=mip_gap,
        fits=fits,
        gpus=tuple(summaries),
        notes=dict(notes or {}),
    )
