"""make_plan: profile + topology + budget + policy -> a scored SwapPlan and its task graph."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.profile import Profile
from pipeswap.sim.graph import TaskGraph
from pipeswap.sim.result import SimResult
from pipeswap.swap.bounds import LowerBound, TurnBound, lower_bound, turn_bound
from pipeswap.swap.case import Case
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.policies import fits as assignment_fits
from pipeswap.swap.policies import heuristic
from pipeswap.swap.scoring import Scored
from pipeswap.swap.workload import DEFAULT_BUCKET_BYTES, Workload, workload_from_profile
from pipeswap.units import format_bytes

POLICIES = (
    "none",
    "oblivious",
    "disjoint",
    "bidirectional",
    "recompute",
    "save-on-cpu",
    "hybrid",
    "mip",
    "auto",
)
# Baselines that plan without looking at the budget: they may not fit it.
UNCHECKED = ("none", "recompute", "save-on-cpu")
DEFAULT_TIME_LIMIT_S = 60.0


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
        return {
            "gpu": self.gpu,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "swapped_bytes": self.swapped_bytes,
            "stall_s": self.stall_s,
            "offset_s": self.offset_s,
            "recomputed_layers": self.recomputed_layers,
            "recompute_s": self.recompute_s,
        }


@dataclass(frozen=True)
class PlanResult:
    """A plan with the exact graph that was scored, its simulation and summary numbers.

    ``topology`` carries the budget as every GPU's memory: simulating ``graph`` on it
    (``pipeswap simulate --graph G --topology T --gpu-memory BUDGET``) gives
    ``iteration_s`` again. ``fits`` is False only for the baselines that ignore the budget
    (``none``, ``recompute``, ``save-on-cpu``) when their peak exceeds it; their graph is
    then scored without a memory limit.
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
        """The turn bound (pipeswap.swap.bounds): each GPU's bytes leave during its forward
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

    def reproduce_command(self, graph_path: str = "graph.json", topology: str | None = None) -> str:
        """The command that re-simulates the exported graph to the same iteration time."""
        memory = self.budget_bytes if self.fits else 0
        return (
            f"pipeswap simulate --graph {graph_path} --topology {topology or self.topology.name} "
            f"--gpu-memory {memory}"
        )

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


def resolve_budget(
    workload: Workload,
    topology: Topology,
    gpus: Sequence[str],
    *,
    gpu_memory_bytes: int | None,
    footprint_ratio: float | None,
) -> int:
    """The per-GPU budget in bytes; refuses budgets below what can never be swapped."""
    if gpu_memory_bytes is not None and footprint_ratio is not None:
        raise PipeswapError("give either --gpu-memory or --footprint-ratio, not both")
    peak = workload.no_swap_peak_bytes()
    if footprint_ratio is not None:
        if not footprint_ratio >= 1.0 or math.isinf(footprint_ratio):
            raise PipeswapError(
                f"--footprint-ratio is {footprint_ratio}; use a ratio >= 1 (1.5 = the no-swap "
                "peak is 1.5 times the GPU memory)"
            )
        budget = int(peak / footprint_ratio)
    elif gpu_memory_bytes is not None:
        budget = gpu_memory_bytes
    else:
        budget = min(topology.node(g).memory_bytes for g in gpus)
        if budget <= 0:
            raise PipeswapError(
                f"topology {topology.name!r} gives no GPU memory; pass --gpu-memory or "
                "--footprint-ratio"
            )
    smallest = workload.min_budget_bytes()
    if budget < smallest:
        raise PipeswapError(
            f"a budget of {budget} bytes ({format_bytes(budget)}) per GPU is below what "
            f"{workload.model} can never swap (parameters, gradients, optimizer state and "
            f"its largest layer's working set); the smallest budget that works is {smallest} "
            f"bytes ({format_bytes(smallest)}), a footprint ratio of at most "
            f"{peak / smallest:.3f}: pass --gpu-memory {smallest} or more"
        )
    return budget


def select_gpus(topology: Topology, gpus: int | Sequence[str] | None) -> tuple[str, ...]:
    """The data-parallel GPUs: all by default, the first N, or the named ones."""
    available = topology.gpus
    if gpus is None:
        return tuple(available)
    if isinstance(gpus, int):
        if not 1 <= gpus <= len(available):
            raise PipeswapError(
                f"--gpus is {gpus}; topology {topology.name!r} has {len(available)} GPUs "
                f"({', '.join(available)}): use 1 to {len(available)}"
            )
        return tuple(available[:gpus])
    for gpu in gpus:
        topology.node(gpu)
        if topology.node(gpu).kind != "gpu":
            raise PipeswapError(f"{gpu!r} is not a GPU of topology {topology.name!r}")
    return tuple(gpus)


def make_case(
    profile: Profile,
    topology: Topology,
    *,
    gpus: int | Sequence[str] | None = None,
    gpu_memory_bytes: int | None = None,
    footprint_ratio: float | None = None,
    sync_every: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Case:
    """The planning problem, with the budget checked and written into the topology."""
    if sync_every < 1:
        raise PipeswapError(f"--sync-every is {sync_every}; use 1 or more")
    if bucket_bytes <= 0:
        raise PipeswapError(f"bucket size is {bucket_bytes} bytes; use a positive size")
    workload = workload_from_profile(profile)
    chosen = select_gpus(topology, gpus)
    budget = resolve_budget(
        workload,
        topology,
        chosen,
        gpu_memory_bytes=gpu_memory_bytes,
        footprint_ratio=footprint_ratio,
    )
    return Case(
        workload=workload,
        topology=topology.with_gpu_memory(budget),
        gpus=chosen,
        budget_bytes=budget,
        sync_every=sync_every,
        bucket_bytes=bucket_bytes,
    )


def make_plan(
    profile: Profile,
    topology: Topology,
    *,
    policy: str,
    gpus: int | Sequence[str] | None = None,
    gpu_memory_bytes: int | None = None,
    footprint_ratio: float | None = None,
    sync_every: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> PlanResult:
    """Plan one iteration of data-parallel training of ``profile`` on ``topology``.

    ``policy`` is one of POLICIES. The budget is ``gpu_memory_bytes``, the no-swap peak
    divided by ``footprint_ratio``, or else the topology's GPU memory.
    """
    if policy not in POLICIES:
        raise PipeswapError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
    case = make_case(
        profile,
        topology,
        gpus=gpus,
        gpu_memory_bytes=gpu_memory_bytes,
        footprint_ratio=footprint_ratio,
        sync_every=sync_every,
        bucket_bytes=bucket_bytes,
    )
    return plan_case(case, profile, policy, time_limit_s=time_limit_s)


def plan_case(
    case: Case, profile: Profile, policy: str, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S
) -> PlanResult:
    """Run ``policy`` on an already checked ``case``."""
    started = time.perf_counter()
    notes: dict[str, Any] = {}
    mip_gap: float | None = None
    if policy in UNCHECKED:
        return _score_unchecked(case, profile, policy, started)
    if policy in ("oblivious", "disjoint", "bidirectional", "hybrid"):
        scored = case.score(heuristic(case, policy))
    elif policy == "mip":
        from pipeswap.swap.mip import plan_mip

        outcome = plan_mip(case, time_limit_s=time_limit_s)
        scored, mip_gap, notes = outcome.scored, outcome.mip_gap, outcome.notes
    elif policy == "auto":
        from pipeswap.swap.auto import plan_auto

        scored, notes = plan_auto(case, time_limit_s=time_limit_s)
        mip_gap = notes.get("mip_gap")
    else:  # pragma: no cover - guarded by make_plan
        raise PipeswapError(f"unknown policy {policy!r}")
    solve_s = time.perf_counter() - started
    return summarize(case, profile, policy, scored, solve_s=solve_s, mip_gap=mip_gap, notes=notes)


def _score_unchecked(case: Case, profile: Profile, policy: str, started: float) -> PlanResult:
    assignment = heuristic(case, policy)
    if assignment_fits(case, assignment):
        scored = case.score(assignment)
        return summarize(case, profile, policy, scored, solve_s=time.perf_counter() - started)
    # It does not fit: score it without a limit so the table can still show its peak.
    unlimited = Case(
        case.workload,
        case.topology.with_gpu_memory(0),
        case.gpus,
        case.budget_bytes,
        case.sync_every,
        case.bucket_bytes,
    )
    scored = unlimited.score(assignment)
    peak = max(stats.peak_bytes for stats in scored.result.gpus.values())
    what = {
        "none": "the no-swap peak",
        "recompute": "the peak with every block recomputed",
        "save-on-cpu": "the peak with every saved tensor on host",
    }[policy]
    notes = {
        "failure": f"does not fit: {what} {peak} bytes ({format_bytes(peak)}) exceeds "
        f"the budget {case.budget_bytes} bytes ({format_bytes(case.budget_bytes)})"
    }
    return summarize(
        unlimited,
        profile,
        policy,
        scored,
        solve_s=time.perf_counter() - started,
        notes=notes,
        fits=False,
        budget_bytes=case.budget_bytes,
    )


def summarize(
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
        decisions = tuple(
            SwapDecision(
                layer=names[s.layer],
                index=s.index,
                bytes=s.bytes,
                out_after=names[s.out],
                prefetch_after=None if s.prefetch >= len(names) else names[s.prefetch],
            )
            for s in swaps
        )
        offset = float(assignment.offsets_s.get(gpu, 0.0))
        recomputed = sorted(assignment.recomputed(gpu))
        gpu_plans.append(
            GpuPlan(gpu, rank, budget, offset, decisions, tuple(names[i] for i in recomputed))
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
