"""offload(model): a model's saved tensors swapped to host memory inside your own training loop."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.dist.ddp import unwrap
from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import candidate_layers, every_stack
from pipeswap.profiling.block_timing import BlockTiming, time_blocks, watch_backward_end
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.learning import SAID, learning_step
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.training import loop_calls, loop_optimizers
from pipeswap.training.loop_calls import Signature
from pipeswap.training.loop_meter import LoopMeter
from pipeswap.training.loop_plans import LoopPlanner, offload_names
from pipeswap.training.loop_shapes import ShapePlans, describe
from pipeswap.training.loop_stats import NO_CALL, no_plan_stats, plan_stats
from pipeswap.training.shape_plan import ShapePlan
from pipeswap.units import parse_bytes

__all__ = ["Offload", "offload"]


def offload(
    model: nn.Module,
    *,
    footprint_ratio: float | None = None,
    gpu_memory: int | str | None = None,
    policy: str = SwapConfig.policy,
    topology: str | None = None,
    layers: Sequence[str] | None = None,
    optimizer: str | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = "adamw",
    time_limit_s: float | None = None,
    check_memory: bool | None = None,
    on_infeasible: str = "error",
    whole_blocks: bool = SwapConfig.whole_blocks,
) -> Offload:
    """Swap ``model``'s saved tensors to host memory in your own loop, planned for you.

    ``with off:`` around the forward (``off = offload(model, footprint_ratio=1.5)``); the backward
    and the optimizer step stay yours. The first call is learnt within a plan's memory (each
    layer's saved tensors on the host once it has run) while timed; the next forward plans it
    (``policy``, within the run's budget, on ``topology`` or this machine's) and every call it
    covers runs the plan; ``off.plan_for(**largest_batch)`` does so before the loop. Losses
    and weights stay bit-identical to the loop without it (run with ``use_cache=False``, as
    offload passes it). A loop that holds the model's outputs (``outputs = model(...)``)
    through its backward is planned with them held. Under your own DDP, rank 0 makes the first
    plan for every rank (swaps coordinate them), and a shape one rank meets alone, it plans
    alone. ``model`` is what the loop calls (or a submodule it calls, whose forward runs the
    layers). ``layers`` are the submodules plans cut at (default: the model's repeated
    blocks); ``optimizer`` says which state the budget counts (pass the optimizer itself, or a
    list of every optimizer the loop steps, to have their state counted as it is);
    ``whole_blocks`` recomputes whole blocks only (SwapConfig.whole_blocks). ``time_limit_s``
    bounds the search of the policies that search (``auto``, ``mip``; a derived plan takes the
    heuristics), inside the user's step: by default about two steps' time, at most 1 s.

    The budget is what the device's own meter counts (pipeswap.profiling.meter: CUDA's allocator; on
    the CPU the live storages): a measured shape's step reads the meter at every layer's edges, so
    the plan counts what the model holds outside the layers (its head, logits and loss), the working
    sets, autocast's weight copies and the optimizer step. ``check_memory`` (default: on CUDA)
    measures the first step that runs each plan; if it held more than the budget, the shape is
    planned again for that much less, at most twice (a warning says so); ``check_memory=True``
    reads every step too (``stats()["step_peak_bytes"]``: CUDA's peak, reset at each forward;
    on the CPU the storages of its forward and backward, counted by a dispatch mode: slower
    steps); ``stats()`` states it beside the budget and the prediction.

    Batches of every length: the budget is resolved once, at the first plan, and every
    later shape keeps it. A plan made for one call serves every smaller call of the same
    structure (pipeswap.training.loop_shapes); a shape no plan covers is planned before
    its forward, its profile derived from the shapes measured (loop_derive; ``stats()``'s
    ``derived_from``). A shape no plan fits within the budget is refused before its
    forward, naming the largest shape planned and the longest rows that fit
    (``on_infeasible="error"``), or runs recomputing every layer, with a warning.
    """
    if on_infeasible not in INFEASIBLE:
        raise ConfigError(
            f"on_infeasible {on_infeasible!r} is not a choice; use one of {', '.join(INFEASIBLE)}"
        )
    with offload_names():
        try:
            memory = parse_bytes(gpu_memory) if isinstance(gpu_memory, str) else gpu_memory
        except PipeswapError as exc:
            raise ConfigError(f"{{gpu_memory_bytes}} {gpu_memory!r}: {exc}") from None
        config = SwapConfig(
            policy=policy,
            gpu_memory_bytes=memory,
            footprint_ratio=footprint_ratio,
            time_limit_s=SEARCH_AT_MOST_S if time_limit_s is None else time_limit_s,
            whole_blocks=whole_blocks,
        )
    offloading = Offload(
        model,
        config,
        layers=layers,
        optimizer=optimizer,
        topology=topology,
        check_memory=check_memory,
        on_infeasible=on_infeasible,
    )
    offloading.planner.search_steps = SEARCH_STEPS if time_limit_s is None else None
    return offloading


# A plan's search takes about this many steps' time by default, at most SEARCH_AT_MOST_S.
SEARCH_STEPS = 2.0
SEARCH_AT_MOST_S = 1.0
# What offload does with a shape no plan fits within the run's budget.
INFEASIBLE = ("error", "recompute-all")
# The Offload whose context is open on a model: two on one model would swap each other's.
_ENTERED: weakref.WeakKeyDictionary[nn.Module, Offload] = weakref.WeakKeyDictionary()


class Offload:
    """The reusable context manager :func:`offload` returns (see there)."""

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        *,
        layers: Sequence[str] | None = None,
        optimizer: str | torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = "adamw",
        topology: str | None = None,
        check_memory: bool | None = None,
        on_infeasible: str = "error",
    ) -> None:
        self.model = loop_calls.called_module(unwrap(model))
        self.config = config
        self.topology = topology
        if layers is None:
            try:
                layers = every_stack(self.model)
            except PipeswapError as exc:  # the hint in offload's words
                raise PipeswapError(
                    f"{str(exc).split('; name its blocks')[0]}; name the submodules to cut "
                    f"at, in forward order: offload(model, layers={candidate_layers(self.model)})"
                ) from None
        self.layer_names = list(layers)
        # A Hugging Face model builds a key/value cache in training forwards by default: it
        # holds every layer's keys and values, so swapping or recomputing them frees nothing.
        self._takes_use_cache = loop_calls.takes_use_cache(self.model.forward, self.model)
        self.layers = resolve_layers(self.model, self.layer_names)
        self.optimizer, self.optimizers = loop_optimizers.given_optimizers(self.model, optimizer)
        self._optimizer_hooks = [
            hook(lambda *_, starting=starting: self.meter.optimizer_step(starting))
            for o in self.optimizers
            for hook, starting in (
                (o.register_step_pre_hook, True),
                (o.register_step_post_hook, False),
            )
        ]
        device = self._device()
        self.check_memory = device.type == "cuda" if check_memory is None else check_memory
        self.every_step = check_memory is True  # asked for: every step is read (CUDA)
        # The step timed last, to plan at the next forward: its call, signature and timing.
        self._timed: tuple[Signature, tuple[Any, Any], BlockTiming] | None = None
        self._last_call: dict[str, Any] = dict(NO_CALL)  # stats() of the step that ran
        self._timing_hooks: list[Any] = []
        self._root_hooks: list[Any] = []
        self._inside = False  # a planning forward of our own: the hooks stand aside
        self._step: Any = None  # the executor forward in flight
        self._pending: SwapExecutor | None = None  # whose step ends at the next forward
        self._last: StepStats | None = None
        self._last_plan: ShapePlan | None = None
        self._outputs = loop_calls.HeldOutputs()  # does the loop hold them into the next?
        self.steps = 0
        self.learning_steps = 0
        self.planner = LoopPlanner(
            self.model,
            self.layers,
            config,
            topology,
            device,
            self._quiet,
            (self.model, self.optimizers),
            self.host_pools,
            on_infeasible,
        )
        if device.type == "cpu" and model is not self.model:  # DDP: its buckets, unseen
            self.planner.unseen_bytes = loop_optimizers.trainable_bytes(self.model)  # (CPU count)
        self.shapes = ShapePlans(self.planner, check_memory=self.check_memory)
        self.shapes.settings = self._plan_settings
        self.meter = LoopMeter(device, (self.model, self.optimizers), self.planner.measured)

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
        if self._root_hooks or _ENTERED.get(self.model, self) is not self:
            raise RuntimeError("offload contexts do not nest; leave the first one before")
        _ENTERED[self.model] = self
        self._root_hooks = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._root_hooks:
            handle.remove()
        self._root_hooks = []
        _ENTERED.pop(self.model, None)
        if self._step is not None:  # the forward raised: leave its swapping context
            step, self._step = self._step, None
            step.__exit__(*exc)

    def close(self) -> None:
        """Remove every hook the plans installed on the model."""
        self._end_pending()
        self._remove_timing()
        self.meter.stop()
        for handle in self._optimizer_hooks:
            handle.remove()
        self._optimizer_hooks = []
        self.shapes.close()

    # ---- hooks on the model's own call ----------------------------------------------
    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if self._inside or not torch.is_grad_enabled():
            return None
        loop_calls.refuse_transforms()
        if self._takes_use_cache:
            kwargs = loop_calls.without_cache(kwargs, args)
        self._end_pending()
        self._remove_timing()
        held_bytes = self.meter.stop((args, kwargs), self._unseen_state())
        started = time.perf_counter()
        # (a step learnt with other parameters frozen is planned in its own: LoopShapes)
        self.shapes.trainable_changed(self.model)
        self.shapes.outputs_held(self._outputs.held())
        self.shapes.grads_held(self.model, self._device())  # before planning: counted once
        signature = self._signature(args, kwargs)
        if self._timed is not None:  # the previous step learnt a shape: plan it now
            (timed, call, timing), self._timed = self._timed, None
            memory = timing.step_memory(self.layer_names, held_bytes)
            call = (args, kwargs) if timed == signature else call  # (the last one can go)
            self.shapes.plan(timed, call, timing, memory, **self._plan_settings())
        covering, planned = self.shapes.serving(signature, args, kwargs, self._device())
        self._last_call = {
            "shape": describe(signature),
            "planned_shape": None if covering is None else describe(covering),
            "step_planning_s": time.perf_counter() - started,
            "learning": None,
        }
        if planned is not None and self.check_memory and planned.measured_peak_bytes is None:
            self.meter.watch(planned)
        elif self.every_step and planned is not None:  # (a timed step is read at its edges)
            self.meter.watch_step((args, kwargs), self._unseen_state(), planned)
        if planned is None:  # the first call of its structure: learnt, timed
            how = self.planner.learnt_by  # within a plan's memory, not the no-swap peak
            self._last_call["learning"] = f"the first call of its structure {SAID[how]}"
            self._timed = (signature, (args, kwargs), self._start_timing((args, kwargs)))
            self.learning_steps += 1
            self._last_plan = self._last = None
            self._step = learning_step(how, self.model, self.layers, self._timed[2])
            self._step.__enter__()
            return args, kwargs
        self._last_plan = planned
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
        self._outputs.watch(output)
        if self._timed is not None and torch.is_grad_enabled():
            timing = self._timed[2]
            self._timing_hooks += watch_backward_end(timing, output, self.layer_names)
            timing.forward_done = True  # a forward before the backward is not timed
        if self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def _end_pending(self) -> None:
        if self._pending is not None:
            self._last, self._pending = self._pending.finish_step(), None
            self.steps += 1
            self.shapes.step_ended()

    # ---- learning a shape -------------------------------------------------------------
    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def host_pools(self) -> list[torch.Tensor]:
        """The host memory the plans swap into (never the device's: meters leave it out)."""
        return [
            p.executor.pool.buffer for p in self.shapes.plans.values() if p.executor is not None
        ]

    def _start_timing(self, call: tuple[Any, Any]) -> BlockTiming:
        timing = BlockTiming()
        self.meter.time(timing, optimizer_hooked=bool(self.optimizers), holding=call)
        self._timing_hooks = time_blocks(self.layers, timing, self._device())
        return timing

    def _remove_timing(self) -> None:
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = []

    def plan_for(self, *args: Any, **kwargs: Any) -> None:
        """Plan for this call of the model before the loop: give it the largest batch the
        loop will see (its batch size, its longest sequence), as the loop passes it. Every
        call it covers (the same arguments, no tensor larger in any dimension) then runs
        the plan from its first step, within the one budget (a larger one is planned
        before its forward, within the same budget, or refused where none fits). It runs
        one forward and backward aside, timed and metered; gradients, buffers and random
        streams are left as they were."""
        if self._takes_use_cache:
            kwargs = loop_calls.without_cache(kwargs, args)
        self._end_pending()
        self.shapes.trainable_changed(self.model)
        self.meter.end_count()  # the step run aside is not the user's
        started = time.perf_counter()
        signature = self._signature(args, kwargs)
        timing, memory = self.planner.aside(args, kwargs, state_bytes=self._unseen_state())
        self.shapes.plan(
            signature, (args, kwargs), timing, memory, aside=True, **self._plan_settings()
        )
        self.shapes.declared = signature
        # The step run aside is part of planning here (in the loop, the user's is timed).
        self.shapes.plans[signature].planning_s = time.perf_counter() - started

    def _plan_settings(self) -> dict[str, Any]:
        """What this model's plans are made with (LoopShapes.plan's settings)."""
        return {
            "optimizer": self.optimizer,
            "step_peak_bytes": self.meter.step_peak_bytes,
            # A step run aside starts without the loop's gradients (profiling.metered_step).
            "state_bytes": self._unseen_state() + self.shapes.grad_bytes,
            "check_memory": self.check_memory,
        }

    def _signature(self, args: Any, kwargs: Any) -> Signature:
        return loop_calls.signature(args, kwargs, self._device(), loop_calls.modes_of(self.model))

    def _unseen_state(self) -> int:
        return loop_optimizers.unseen_state_bytes(self.model, self.optimizer, self.optimizers)

    # ---- what it did ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the last step did (call it after a step's backward): its ``shape``, the shape
        whose plan it ran (``planned_shape``; None: learnt, the first of its structure, and
        ``learning`` says how), its forward's planning time; bytes swapped and recomputed,
        late fetches; with ``check_memory=True`` the meter's peak over this step so far
        (``step_peak_bytes``, else None); the run's budget; of the plan it ran, the
        policy, the predicted step and stall, the predicted peak beside the meter's (of its
        first step; while that runs, the most so far), its planning time and replans, and
        ``derived_from``: the shapes measured it was derived from (None: measured)."""
        self._end_pending()
        out: dict[str, Any] = {
            "steps": self.steps,
            "learning_steps": self.learning_steps,
            "plans": len(self.shapes.plans),
            **self._last_call,
            "budget_bytes": self.planner.budget_bytes,
            "total_planning_s": sum(p.planning_s for p in self.shapes.plans.values()),
        }
        out.update((self._last or StepStats(0, 0, 0, 0, 0.0)).to_json())
        self.meter.end_count()  # the CPU's count reads the forward and backward
        out["step_peak_bytes"] = self.meter.step_peak_so_far()
        out["unmatched_tensors"] = sum(
            p.executor.unmatched for p in self.shapes.plans.values() if p.executor is not None
        )
        if self._last_plan is None:
            out.update(no_plan_stats(self.config.policy))
        else:
            out.update(plan_stats(self._last_plan, self.meter.peak_so_far(self._last_plan)))
        return out
