"""offload(model): a model's saved tensors swapped to host memory inside your own training loop."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import torch
from torch import nn

from pipeswap.config import ConfigError
from pipeswap.dist.ddp import unwrap
from pipeswap.dist.group import rank_and_world
from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import find_blocks
from pipeswap.profiling.block_timing import BlockTiming, time_blocks
from pipeswap.profiling.meter import DeviceMeter, MemoryMarks
from pipeswap.swap.config import SwapConfig
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.training.loop_calls import Signature, optimizer_name, takes_use_cache, without_cache
from pipeswap.training.loop_calls import signature as call_signature
from pipeswap.training.loop_plans import LoopPlanner, ShapePlan, offload_names
from pipeswap.training.loop_profile import loop_profile
from pipeswap.units import parse_bytes


def offload(
    model: nn.Module,
    *,
    footprint_ratio: float | None = None,
    gpu_memory: int | str | None = None,
    policy: str = SwapConfig.policy,
    topology: str | None = None,
    layers: Sequence[str] | None = None,
    optimizer: str | torch.optim.Optimizer = "adamw",
    time_limit_s: float = 1.0,
    check_memory: bool | None = None,
) -> Offload:
    """Swap ``model``'s saved tensors to host memory in your own loop, planned for you.

    ``with off:`` around the forward (``off = offload(model, footprint_ratio=1.5)``); the
    backward and the optimizer step stay yours. The first forward of each input shape runs
    as it is while its layers are timed; the next one of that shape makes a plan (the
    contention-aware planner, ``policy``, within ``gpu_memory`` bytes or the no-swap
    peak / ``footprint_ratio``, on ``topology`` or the one of this machine) and every later
    one runs it. Losses and weights stay bit-identical to the loop without it. Under your
    own DDP, rank 0 plans for every rank (disjoint and bidirectional swaps coordinate
    them): every rank must see the same input shapes at the same steps, as a
    DistributedSampler gives. ``layers`` are the submodules plans cut at (default: the
    model's repeated block list); ``optimizer`` says which state the budget counts (pass
    the optimizer itself to have its state counted as it is). ``time_limit_s`` bounds the
    search of the policies that search (``auto``, ``mip``): a plan comes in about that
    long, inside the user's step.

    The budget is what the device's own meter counts (pipeswap.profiling.meter: CUDA's
    allocator; on the CPU the live storages): the first step of a shape reads the meter at
    every layer's edges, so the plan counts what the model holds outside the layers (its
    head, logits and loss), the working sets, autocast's weight copies and the optimizer
    step. ``check_memory`` (default: on CUDA) measures the first step that runs each plan;
    if it held more than the budget, the shape is planned again for that much less, at
    most twice (a warning says so). ``stats()`` states the measured peak beside the budget
    and the plan's prediction.
    """
    with offload_names():
        try:
            memory = parse_bytes(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
        except PipeswapError as exc:
            raise ConfigError(f"{{gpu_memory_bytes}} {gpu_memory!r}: {exc}") from None
        config = SwapConfig(
            policy=policy,
            gpu_memory_bytes=memory,
            footprint_ratio=footprint_ratio,
            time_limit_s=time_limit_s,
        )
    return Offload(
        model,
        config,
        layers=layers,
        optimizer=optimizer,
        topology=topology,
        check_memory=check_memory,
    )


class Offload:
    """The reusable context manager :func:`offload` returns (see there)."""

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        *,
        layers: Sequence[str] | None = None,
        optimizer: str | torch.optim.Optimizer = "adamw",
        topology: str | None = None,
        check_memory: bool | None = None,
    ) -> None:
        self.model = unwrap(model)
        self.config = config
        self.topology = topology
        if layers is None:
            try:
                layers = find_blocks(self.model)
            except PipeswapError:
                raise PipeswapError(
                    f"{type(self.model).__name__} has no list of 2 or more layers of one "
                    "class for plans to cut at; name the submodules to cut at, in forward "
                    "order: offload(model, layers=['encoder.0', 'encoder.1', ...])"
                ) from None
        self.layer_names = list(layers)
        # A Hugging Face model builds a key/value cache in training forwards unless told
        # not to (its default): the cache holds every layer's keys and values beyond the
        # backward's use of them, so swapping or recomputing them would free nothing.
        self._takes_use_cache = takes_use_cache(self.model.forward)
        self.layers = resolve_layers(self.model, self.layer_names)
        self.optimizer_state: torch.optim.Optimizer | None = None
        self._optimizer_hooks: list[Any] = []
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer_state = optimizer
            self._optimizer_hooks = [
                optimizer.register_step_pre_hook(lambda *_: self._optimizer_step(True)),
                optimizer.register_step_post_hook(lambda *_: self._optimizer_step(False)),
            ]
            optimizer = optimizer_name(optimizer)
        self.optimizer = optimizer
        device = self._device()
        self.check_memory = device.type == "cuda" if check_memory is None else check_memory
        self._meter: DeviceMeter | None = None  # CUDA: reading a step, to the next forward
        self._measuring: ShapePlan | None = None  # whose first step the meter reads
        self._step_peak_due = False  # CPU: read the next optimizer step
        self._step_meter: DeviceMeter | None = None
        self._step_peak_bytes = 0  # CPU: the optimizer step's peak, when read
        self._timings: dict[Signature, BlockTiming] = {}
        self._planned: dict[Signature, ShapePlan] = {}
        self._timing_hooks: list[Any] = []
        self._root_hooks: list[Any] = []
        self._inside = False  # a planning forward of our own: the hooks stand aside
        self._step: Any = None  # the executor forward in flight
        self._pending: SwapExecutor | None = None  # whose step ends at the next forward
        self._last: StepStats | None = None
        self._last_plan: ShapePlan | None = None
        self._timing: BlockTiming | None = None  # the timed step the meter reads
        self.steps = 0
        self.plain_steps = 0
        self.planner = LoopPlanner(
            self.model,
            self.layers,
            config,
            topology,
            device,
            self._quiet,
            (self.model, self.optimizer_state),
            self.host_pools,
        )

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """A forward of pipeswap's own: the hooks stand aside."""
        self._inside = True
        try:
            yield
        finally:
            self._inside = False

    # ---- the context ----------------------------------------------------------------
    def __enter__(self) -> Offload:
        if self._root_hooks:
            raise RuntimeError("offload contexts do not nest; leave the first one before")
        self._root_hooks = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for handle in self._root_hooks:
            handle.remove()
        self._root_hooks = []
        if self._step is not None:  # the forward raised: leave its swapping context
            step, self._step = self._step, None
            step.__exit__(kind, value, traceback)

    def close(self) -> None:
        """Remove every hook the plans installed on the model."""
        self._end_pending()
        self._remove_timing()
        self._stop_meter()
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []
        for planned in self._planned.values():
            if planned.executor is not None:
                planned.executor.close()
        self._planned.clear()

    # ---- hooks on the model's own call ----------------------------------------------
    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._inside or not torch.is_grad_enabled():
            return None
        if self._takes_use_cache:
            kwargs = without_cache(kwargs)
        self._end_pending()
        self._remove_timing()
        held_bytes = self._stop_meter()
        signature = call_signature(args, kwargs, self._device())
        planned = self._planned.get(signature)
        timing = self._timings.get(signature)
        if planned is None and timing is not None and timing.complete(self.layer_names):
            planned = self._plan(signature, args, kwargs, held_bytes)
        elif planned is not None and planned.replan_due:
            planned = self._planned[signature] = self.planner.replan(planned, args, kwargs)
        if planned is None:
            self._start_timing(signature)
            self.plain_steps += 1
            return args, kwargs
        self._last_plan = planned
        if self.check_memory and planned.measured_peak_bytes is None:
            self._start_meter(planned)
        executor = planned.executor
        if executor is None:
            self.steps += 1
            self._last = None
            return args, kwargs
        offset = executor.gpu_plan.offset_s
        if offset > 0:  # this rank starts later, so its swaps meet its neighbour's fetches
            if executor.device.type == "cuda":
                torch.cuda.synchronize(executor.device)
            time.sleep(offset)
        self._step = executor.forward()
        self._step.__enter__()
        self._pending = executor
        return args, kwargs

    def _after(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._inside:
            return
        if self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def _end_pending(self) -> None:
        if self._pending is not None:
            self._last = self._pending.finish_step()
            self._pending = None
            self.steps += 1

    # ---- learning a shape -------------------------------------------------------------
    def _device(self) -> torch.device:
        first = next(self.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def host_pools(self) -> list[torch.Tensor]:
        """The host memory the plans swap into (never the device's: meters leave it out)."""
        return [p.executor.pool.buffer for p in self._planned.values() if p.executor is not None]

    def _start_timing(self, signature: Signature) -> None:
        timing = self._timings[signature] = BlockTiming()
        if self._device().type == "cuda":
            # The allocator sees the whole step as the loop runs it, the user's loss and
            # optimizer step included; read at the layers' edges, until the next forward.
            self._meter = DeviceMeter(self._device())
            timing.marks = MemoryMarks(self._meter)
            self._timing = timing
        else:
            self._step_peak_due = self.optimizer_state is not None
        self._timing_hooks = time_blocks(self.layers, timing, self._device())

    def _start_meter(self, planned: ShapePlan) -> None:
        """Read the allocator over the first step that runs ``planned`` (to the next forward)."""
        self._meter = DeviceMeter(self._device())
        self._meter.reset_peak()
        self._measuring = planned

    def _optimizer_step(self, starting: bool) -> None:
        """The given optimizer's step hooks: on the CPU the storage count reads the step
        after a timed one (a mode that begins and ends inside the step)."""
        if starting and self._step_peak_due:
            self._step_peak_due = False
            meter = DeviceMeter(self._device(), holding=(self.model, self.optimizer_state))
            meter.__enter__()
            self._step_meter = meter
        elif not starting and self._step_meter is not None:
            meter, self._step_meter = self._step_meter, None
            meter.__exit__(None, None, None)
            self._step_peak_bytes = meter.peak

    def _stop_meter(self) -> int | None:
        """End the step the meter reads (at the next forward, so the optimizer step counts):
        a timed step's last interval, or a plan's first step, checked against its budget.
        Returns what the device holds now (None without a meter)."""
        meter, self._meter = self._meter, None
        if meter is None:
            return None
        timing, self._timing = self._timing, None
        if timing is not None and timing.marks is not None:
            timing.marks.close("step")
        held, peak = meter.current, meter.peak
        planned, self._measuring = self._measuring, None
        if planned is not None:
            self.planner.measured(planned, peak)
        return held

    def _remove_timing(self) -> None:
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = []

    def _plan(
        self, signature: Signature, args: Any, kwargs: Any, held_bytes: int | None
    ) -> ShapePlan:
        """Plan this shape from its timing and one forward that names its saved tensors."""
        started = time.perf_counter()
        timing = self._timings.pop(signature)
        planner = self.planner
        records, kept, rerun = planner.name_tensors(args, kwargs)
        memory = timing.step_memory(self.layer_names, held_bytes)
        if memory is None:
            memory = planner.metered_memory(args, kwargs, self._step_peak_bytes)
        profile = loop_profile(
            self.model,
            self.layers,
            records,
            timing,
            (args, kwargs),
            optimizer=self.optimizer,
            memory=memory,
            kept=kept,
            rerun=rerun,
        )
        budget = planner.budget(profile)
        result, executor = planner.make(profile, budget, args, kwargs)
        planned = self._planned[signature] = ShapePlan(
            executor, result, profile, budget, time.perf_counter() - started
        )
        if self.check_memory and self._device().type != "cuda":
            # The storage count cannot watch the user's step: a step run aside with the
            # plan is measured, and the plan made again right away if it held more.
            while True:
                planner.measured(planned, planner.metered_plan(planned, args, kwargs))
                if not planned.replan_due:
                    break
                planned = self._planned[signature] = planner.replan(planned, args, kwargs)
        return planned

    # ---- what it did ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the last step did and the plan it ran: bytes swapped and recomputed, late
        fetches, the plan's policy and its predicted step and stall, the budget beside the
        plan's predicted peak and the meter's measured one (of the first step that ran the
        plan; while that step is still being read, the most so far), the planning time
        and how often the shape was planned again (call it after a step's backward)."""
        self._end_pending()
        out: dict[str, Any] = {
            "steps": self.steps,
            "plain_steps": self.plain_steps,
            "plans": len(self._planned),
        }
        out.update((self._last or StepStats(0, 0, 0, 0, 0.0)).to_json())
        out["unmatched_tensors"] = sum(
            p.executor.unmatched for p in self._planned.values() if p.executor is not None
        )
        planned = self._last_plan
        if planned is not None:
            result = planned.result
            rank, _ = rank_and_world()
            out["policy"] = result.policy
            out["predicted_step_s"] = result.iteration_s
            out["predicted_stall_s"] = max(0.0, result.iteration_s - result.compute_s)
            out["budget_bytes"] = planned.budget_bytes
            out["planned_for_bytes"] = result.budget_bytes
            out["predicted_peak_bytes"] = result.gpus[rank].peak_bytes
            measured = planned.measured_peak_bytes
            if measured is None and self._measuring is planned and self._meter is not None:
                measured = self._meter.peak
            out["measured_peak_bytes"] = measured
            workload = workload_from_profile(planned.profile)
            out["no_swap_peak_bytes"] = workload.no_swap_peak_bytes()
            out["smallest_budget_bytes"] = workload.min_budget_bytes()
            out["memory_meter"] = (
                None if planned.profile.memory is None else planned.profile.memory.meter
            )
            out["planning_s"] = planned.planning_s
            out["replans"] = planned.replans
        return out
