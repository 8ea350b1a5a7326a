"""The plans of a user's loop: each shape's plan made within one budget, measured, made again."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pipeswap.config import ConfigError
from pipeswap.dist.group import all_gather, broadcast_from_rank0, rank_and_world
from pipeswap.errors import PipeswapError, first_line
from pipeswap.profile import Profile, StepMemory
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.metered_step import metered_step
from pipeswap.swap.config import SwapConfig
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import PlanResult, make_plan
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.checks import rank_plan
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.recompute import recompute_sizes
from pipeswap.training.data_parallel import swap_topology
from pipeswap.units import format_bytes

# offload()'s argument for a setting of SwapConfig that it names otherwise.
_ARGUMENT = {"gpu_memory_bytes": "gpu_memory"}
# A plan is made again (for less memory) at most this often when its first step held more.
REPLANS = 2


@contextmanager
def offload_names() -> Iterator[None]:
    """Refusals inside name the settings as :func:`offload` calls them (``gpu_memory``)."""
    try:
        yield
    except ConfigError as exc:
        spelled = ConfigError(exc.message)
        spelled.args = (exc.render(lambda name: _ARGUMENT.get(name, name)),)
        raise spelled from None


@dataclass
class ShapePlan:
    """A shape's plan, and its executor (None when the plan moves nothing: no overhead).

    ``budget_bytes`` is the budget the user asked for, ``margin_bytes`` what the plans
    were made tighter by after measured steps held more; ``measured_peak_bytes`` the
    meter's reading of the first step that ran the current plan (None: not yet)."""

    executor: SwapExecutor | None
    result: PlanResult
    profile: Profile
    budget_bytes: int
    planning_s: float
    margin_bytes: int = 0
    replans: int = 0
    measured_peak_bytes: int | None = None
    replan_due: bool = False


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

    @property
    def layer_names(self) -> list[str]:
        return list(self.layers)

    def name_tensors(
        self, args: Any, kwargs: Any
    ) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
        """What each layer saves (one forward as the plan names it), and what recomputing
        each layer would keep and save again (one forward with every layer wrapped for
        recomputation, as the runtime runs it)."""
        with self.quiet():
            return recompute_sizes(
                self.model, self.layers, self.layer_names, lambda: self.model(*args, **kwargs)
            )

    def _metered(
        self, args: Any, kwargs: Any, executor: SwapExecutor | None = None
    ) -> tuple[BlockTiming, int]:
        """One forward and backward of this call run aside under the storage count (with
        ``executor``'s plan when given)."""
        with self.quiet():
            return metered_step(
                self.model,
                lambda: self.model(*args, **kwargs),
                self.layers,
                self.device,
                holding=(*self.holding, args, kwargs),
                exclude=self.pools(),
                around=nullcontext if executor is None else executor.forward,
                finish=None if executor is None else executor.finish_step,
            )

    def metered_memory(self, args: Any, kwargs: Any, step_peak_bytes: int) -> StepMemory | None:
        """The storage count's readings of one forward and backward run aside (the CPU: no
        mode can watch the user's own backward), with the optimizer step as read in the
        loop (``step_peak_bytes``; 0: its parameters and gradients at least)."""
        timing, _ = self._metered(args, kwargs)
        memory = timing.step_memory(self.layer_names)
        if memory is None:
            return None
        grads = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
        )
        return replace(memory, step_peak_bytes=step_peak_bytes or memory.start_bytes + grads)

    def metered_plan(self, planned: ShapePlan, args: Any, kwargs: Any) -> int:
        """The storage count's peak of one forward and backward run aside with ``planned``'s
        executor (its optimizer step not included)."""
        return self._metered(args, kwargs, planned.executor)[1]

    def budget(self, profile: Profile) -> int:
        """The budget in bytes: ``gpu_memory``, the measured no-swap peak / ``footprint_ratio``
        or the GPU's memory."""
        config = self.config
        if config.gpu_memory_bytes is not None:
            return config.gpu_memory_bytes
        if config.footprint_ratio is not None:
            peak = workload_from_profile(profile).no_swap_peak_bytes()
            return int(peak / config.footprint_ratio)
        _, world = rank_and_world()
        where = swap_topology(self.topology, self.device.type, world)
        return min(where.node(gpu).memory_bytes for gpu in where.gpus[:world])

    def make(
        self, profile: Profile, budget: int, args: Any, kwargs: Any
    ) -> tuple[PlanResult, SwapExecutor | None]:
        """Rank 0's plan for ``budget`` bytes, every rank's executor for its part of it."""
        rank, world = rank_and_world()
        config = replace(self.config, gpu_memory_bytes=budget, footprint_ratio=None)
        payload: Any = None
        if rank == 0:
            try:
                where = swap_topology(self.topology, self.device.type, world)
                result = make_plan(profile, where, config, gpus=world)
                payload = (result.plan.to_json(), result)
            except PipeswapError as exc:  # every rank stops, none waits for rank 0
                payload = exc
        payload = broadcast_from_rank0(payload, world)
        if isinstance(payload, PipeswapError):
            with offload_names():
                raise payload
        plan_json, result = payload
        plan = SwapPlan.from_json(plan_json)
        mine = rank_plan(plan, rank)
        executor = None
        if mine.swaps or mine.recompute or mine.offset_s > 0:
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
        _, world = rank_and_world()
        if world > 1:  # every rank plans again, or none: the most any rank held
            peak = max(all_gather(peak, world))
        planned.measured_peak_bytes = peak
        excess = peak - planned.budget_bytes
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
        try:
            result, executor = self.make(planned.profile, target, args, kwargs)
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
        if planned.executor is not None:
            planned.executor.close()
        return replace(
            planned,
            executor=executor,
            result=result,
            replans=planned.replans + 1,
            measured_peak_bytes=None,
            planning_s=planned.planning_s + time.perf_counter() - started,
        )
