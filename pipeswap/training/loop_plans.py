"""The plans of a user's loop: each shape's plan made within one budget, measured, made again."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.dist.group import broadcast_from_rank0, rank_and_world
from pipeswap.errors import PipeswapError, first_line
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.metered_step import metered_step
from pipeswap.profiling.profile import Profile, StepMemory
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import PlanResult, make_plan
from pipeswap.swap.plan.policy_table import policy_entry
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.learning import learning_step, learnt_by
from pipeswap.swap.runtime.recompute_sizes import RecomputeSizes, measure_recomputation
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.training.data_parallel import swap_topology
from pipeswap.training.loop_calls import cut_from_caller, offload_names, on_host
from pipeswap.training.loop_profile import loop_profile
from pipeswap.training.shape_plan import REPLANS, ShapePlan, TriedPlan
from pipeswap.units import format_bytes

__all__ = ["UNBOUNDED", "LoopPlanner", "offload_names"]

# The least time a search is given (a smaller one finds nothing beyond its first guess).
MIN_SEARCH_S = 0.02
# A budget no step reaches: what a plan run beyond the run's budget is checked against.
UNBOUNDED = 2**62


@dataclass
class LoopPlanner:
    """Plans for one model in a user's loop. ``quiet`` wraps every forward it runs itself
    (offload's hooks stand aside); ``holding`` is what the storage count counts as held
    (the model, the optimizer); ``pools`` gives the host pools it must leave out."""

    model: nn.Module
    layers: dict[str, nn.Module]
    config: SwapConfig
    topology: str | None
    device: torch.device
    quiet: Callable[[], AbstractContextManager[Any]]
    holding: tuple[Any, ...]
    pools: Callable[[], list[torch.Tensor]]
    on_infeasible: str = "error"
    # The run's one budget in bytes, resolved at the first plan (see budget()).
    budget_bytes: int | None = None
    # A search (auto, mip) takes at most this many of the profile's steps (None: the
    # config's time limit alone), and never less than MIN_SEARCH_S.
    search_steps: float | None = None
    # Steps run aside hold the model's outputs, as profiles count them (HeldOutputs).
    keep_outputs: bool = True
    # The most a measured step held over its plan's budget, as a fraction of the budget:
    # what the profiles miss; every later plan is made that much tighter from the start.
    overshoot: float = 0.0
    unseen_bytes: int = 0  # held through every step, unseen by the CPU's count (DDP's)
    shared_made: bool = False  # ranks share the first plan; a later shape, each its own

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers)

    @property
    def learnt_by(self) -> str:  # (pipeswap.swap.runtime.learning)
        return learnt_by(self.config.policy)

    def name_tensors(self, args: Any, kwargs: Any) -> RecomputeSizes:
        """What each layer saves (one forward, as plans name it), and what recomputing it
        keeps and saves again, whole or selectively (a forward with every layer wrapped)."""
        args, kwargs = cut_from_caller((args, kwargs))
        with self.quiet():
            return measure_recomputation(
                self.model, self.layers, self.layer_names, lambda: self.model(*args, **kwargs)
            )

    def _metered(
        self, args: Any, kwargs: Any, executor: SwapExecutor | None = None
    ) -> tuple[BlockTiming, int]:
        """One forward and backward of this call run aside under the storage count, with
        ``executor``'s plan (None: as a shape is learnt, pipeswap.swap.runtime.learning)."""
        args, kwargs = cut_from_caller((args, kwargs))
        timing = BlockTiming()  # a learnt step notes its copies back in it
        learning = learning_step(self.learnt_by, self.model, self.layers, timing)
        with self.quiet():
            return metered_step(
                self.model,
                lambda: self.model(*args, **kwargs),
                self.layers,
                self.device,
                holding=(*self.holding, args, kwargs),
                exclude=self.pools(),
                around=(lambda: learning) if executor is None else executor.forward,
                finish=None if executor is None else executor.finish_step,
                timing=timing,
                keep_output=self.keep_outputs,
            )

    def aside(
        self, args: Any, kwargs: Any, step_peak_bytes: int = 0, *, state_bytes: int = 0
    ) -> tuple[BlockTiming, StepMemory | None]:
        """One step of this call run aside, as a shape is learnt, timed and counted (plan_for's,
        or a loop's step whose readings missed an edge), with the optimizer step as read in
        the loop (``step_peak_bytes``; 0: its parameters and gradients at least), and
        ``state_bytes`` of optimizer state added to every reading."""
        timing, _ = self._metered(args, kwargs)
        memory = timing.step_memory(self.layer_names)
        if memory is None:
            return timing, None
        if state_bytes:
            memory = timing.step_memory(self.layer_names, memory.start_bytes + state_bytes)
            assert memory is not None
        grads = sum(p.nbytes for p in self.model.parameters() if p.requires_grad)
        peak = step_peak_bytes or memory.start_bytes + grads
        return timing, replace(memory, step_peak_bytes=peak)

    def metered_plan(self, planned: ShapePlan, args: Any, kwargs: Any) -> int:
        """The storage count's peak of a step (no optimizer step) aside with ``planned``."""
        return self._metered(args, kwargs, planned.executor)[1]

    def budget(self, profile: Profile) -> int:
        """The run's one budget in bytes, resolved at its first plan and kept by every later
        shape: ``gpu_memory``, the first shape's no-swap peak / ``footprint_ratio``, or the
        GPU's memory. The no-swap peak is the learnt step's readings made those of the step
        as it is (pipeswap.profiling.on_host)."""
        if self.budget_bytes is None:
            self.budget_bytes = self._resolve_budget(profile)
        return self.budget_bytes

    def _resolve_budget(self, profile: Profile) -> int:
        if (config := self.config).gpu_memory_bytes is not None:
            return config.gpu_memory_bytes
        if config.footprint_ratio is not None:
            return int(workload_from_profile(profile).no_swap_peak_bytes() / config.footprint_ratio)
        _, world = rank_and_world()
        where = swap_topology(self.topology, self.device.type, world)
        return min(where.node(gpu).memory_bytes for gpu in where.gpus[:world])

    def plan_shape(
        self,
        timing: BlockTiming,
        call: tuple[Any, Any],
        memory: StepMemory | None,
        *,
        optimizer: str,
        step_peak_bytes: int,
        state_bytes: int,
        check_memory: bool,
        shape: str,
        fits: str | None,
    ) -> ShapePlan:
        """Plan one call from its timed step and a forward naming its saved tensors (``memory``:
        the meter's readings; None: a step run aside's, with ``state_bytes`` added). ``shape``
        names it in messages, ``fits`` the largest planned within the budget (None: first)."""
        started = time.perf_counter()
        sizes = self.name_tensors(*call)
        if memory is None:
            memory = self.aside(*call, step_peak_bytes, state_bytes=state_bytes)[1]
        memory = None if memory is None else memory.moved(self.unseen_bytes)
        profile = loop_profile(
            self.model,
            self.layers,
            sizes,
            timing,
            call,
            optimizer=optimizer,
            memory=memory,
            outputs_held=self.keep_outputs,
        )
        planned = self.settle(profile, call, started, shape=shape, fits=fits, check=check_memory)
        self.shared_made = True
        return planned

    def settle(
        self,
        profile: Profile,
        call: tuple[Any, Any],
        started: float,
        *,
        shape: str,
        fits: str | None,
        check: bool,
        configs: Sequence[SwapConfig | None] = (None,),
        derived_from: str | None = None,
        heuristic: str | None = None,
    ) -> ShapePlan:
        """The call's plan from its profile within the run's budget (``configs``: the
        policies to try in turn, None the run's), checked (``check``) by a step run aside
        on the CPU; a call no plan fits is refused or recomputes every layer (plan_shape)."""
        args, kwargs = call
        first = self.budget_bytes is None  # (a refusal then names the smallest budget)
        budget = self.budget(profile)
        recomputes_all, margin, why = False, int(self.overshoot * budget), ""
        for config in configs:
            try:
                if margin:  # tighter by what steps held over their plans, where that fits
                    try:
                        result, executor = self.make(profile, budget - margin, *call, config=config)
                        break
                    except ConfigError:
                        margin = 0
                result, executor = self.make(profile, budget, args, kwargs, config=config)
                break
            except ConfigError as refused:
                if config is configs[-1] and first:
                    raise
                why = str(refused)
        else:
            result, executor = self._beyond_budget(profile, budget, call, shape, fits, why)
            recomputes_all = True
        planned = ShapePlan(
            executor,
            result,
            profile,
            budget,
            time.perf_counter() - started,
            call=on_host(call),
            recomputes_all=recomputes_all,
            derived_from=derived_from,
            heuristic=heuristic,
            margin_bytes=margin,
        )
        if check and self.device.type != "cuda" and not recomputes_all:
            # The storage count cannot watch the user's step: a step run aside with the
            # plan is measured, and the plan made again right away if it held more.
            while True:
                self.measured(planned, self.metered_plan(planned, args, kwargs))
                if not planned.replan_due:
                    break
                planned = self.replan(planned, args, kwargs)
        return planned

    def least_budget(self, profile: Profile) -> int:
        """The least budget the run's policy can hold a call of ``profile`` within."""
        return policy_entry(self.config.policy).least_budget(workload_from_profile(profile))

    def _beyond_budget(
        self, profile: Profile, budget: int, call: tuple[Any, Any], shape: str, fits: str | None,
        why: str,
    ) -> tuple[PlanResult, SwapExecutor | None]:  # fmt: skip
        """A call no plan fits within the run's budget: refused (``on_infeasible="error"``),
        or run recomputing every layer it can (``"recompute-all"``), said in a warning.
        ``fits``: the largest shape planned within it (None: none with the trainable
        parameters this call has, which is a plan's own set); ``why``: the last refusal."""
        least = self.least_budget(profile)
        within = f"the run's budget of {format_bytes(budget)} ({budget} bytes)"
        over = (
            f"a batch of shape {shape} needs at least {format_bytes(least)} ({least} bytes) "
            f"with policy {self.config.policy}, more than {within}"
            if least > budget  # (else the bound is below it, and the plans tried say why)
            else f"no plan keeps a batch of shape {shape} within {within} ({why})"
        ) + (
            f"; the largest shape planned within it is {fits}"
            if fits is not None
            else ", resolved at its first plan, when the model's trainable parameters "
            "were others (unfrozen ones add gradients and optimizer state)"
        )
        if self.on_infeasible != "recompute-all":
            raise ConfigError(
                f"{over}. Cap the batch's length at what fits, give offload(gpu_memory=...) "
                f"{'at least that much' if least > budget else 'more'}, or pass "
                "offload(on_infeasible='recompute-all') to run such batches recomputing "
                "every layer beyond the budget"
            ) from None
        warnings.warn(
            f"pipeswap.offload: {over}; it runs recomputing every layer "
            "(on_infeasible='recompute-all')",
            RuntimeWarning,
            stacklevel=6,
        )
        everything = replace(self.config, policy="recompute")
        try:
            return self.make(profile, least, *call, config=everything)
        except ConfigError:
            # A derived profile's least is a model's, not what the runtime then counts;
            # beyond the budget by the user's choice, the plan has no budget to keep.
            return self.make(profile, UNBOUNDED, *call, config=everything)

    def make(
        self,
        profile: Profile,
        budget: int,
        args: Any,
        kwargs: Any,
        *,
        config: SwapConfig | None = None,
    ) -> tuple[PlanResult, SwapExecutor | None]:
        """The plan for ``budget`` bytes (rank 0's, the first), this rank's executor."""
        rank, world = rank_and_world()
        shared = world > 1 and not self.shared_made
        config = replace(config or self.config, gpu_memory_bytes=budget, footprint_ratio=None)
        if self.search_steps is not None:
            step = max(MIN_SEARCH_S, self.search_steps * profile.compute_s)
            config = replace(config, time_limit_s=min(config.time_limit_s, step))
        payload: Any = None
        if rank == 0 or not shared:
            try:
                where = swap_topology(self.topology, self.device.type, world)
                result = make_plan(profile, where, config, gpus=world).runnable()
                payload = (result.plan.to_json(), result)
            except PipeswapError as exc:  # every rank stops, none waits for rank 0
                payload = exc
        if shared:
            payload = broadcast_from_rank0(payload, world, patient=True)  # rank 0 plans
        if isinstance(payload, PipeswapError):
            try:
                with offload_names(self.model):
                    raise payload
            finally:  # a local holding the exception, whose traceback holds this frame,
                del payload  # would keep the forward's output alive until a collection
        plan_json, result = payload
        plan = SwapPlan.from_json(plan_json)
        executor = SwapExecutor(
            self.model,
            plan,
            rank=rank,
            layers=self.layer_names,
            profile=profile,
            device=self.device,
            account=False,
            strict=False,  # a forward that varies (routing) swaps less, never wrongly
        )
        with self.quiet():
            executor.prepare(lambda: self.model(*args, **kwargs))
        return result, executor

    def measured(self, planned: ShapePlan, peak: int) -> None:
        """A plan's first step held ``peak`` bytes: over the budget, plan again for less."""
        planned.measured_peak_bytes = peak  # (each rank's own: ranks' shapes may differ)
        kept = planned.keep_better()
        if kept is not None:
            warnings.warn(
                f"pipeswap.offload: the plan made again held {format_bytes(peak)}, no less "
                f"than the one before it ({format_bytes(kept)}); keeping that one",
                RuntimeWarning,
                stacklevel=5,
            )
            peak = kept
        excess = peak - planned.budget_bytes
        self.overshoot = max(self.overshoot, excess / planned.budget_bytes)
        if excess > 0 and planned.replans < REPLANS:
            planned.margin_bytes += excess
            planned.replan_due = True

    def replan(self, planned: ShapePlan, args: Any, kwargs: Any) -> ShapePlan:
        """The shape planned again for ``margin_bytes`` less than its budget (a measured step
        held that much more); the plan it has if none fits the smaller budget."""
        started = time.perf_counter()
        planned.replan_due = False
        target = planned.budget_bytes - planned.margin_bytes
        held = format_bytes(planned.measured_peak_bytes or 0)
        over = f"a step held {held}, more than the budget of {format_bytes(planned.budget_bytes)}"
        policy = planned.heuristic
        config = None if policy is None else replace(self.config, policy=policy)
        try:
            result, executor = self.make(planned.profile, target, args, kwargs, config=config)
        except PipeswapError as exc:
            warnings.warn(
                f"pipeswap.offload: {over}, and no plan fits {format_bytes(target)} "
                f"({first_line(exc)}); keeping the plan it has",
                RuntimeWarning,
                stacklevel=5,
            )
            planned.replans = REPLANS
            return planned
        warnings.warn(
            f"pipeswap.offload: {over}; planned again for {format_bytes(target)}",
            RuntimeWarning,
            stacklevel=5,
        )
        tried = None
        if planned.measured_peak_bytes is None:  # never read: nothing to go back to
            if planned.executor is not None:
                planned.executor.close()
        else:
            tried = TriedPlan(planned.executor, planned.result, planned.measured_peak_bytes)
        return replace(
            planned,
            executor=executor,
            result=result,
            tried=tried,
            replans=planned.replans + 1,
            measured_peak_bytes=None,
            planning_s=planned.planning_s + time.perf_counter() - started,
        )
