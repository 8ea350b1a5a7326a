"""offload(model): a model's saved tensors swapped to host memory inside your own training loop."""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.config import ConfigError
from pipeswap.dist.ddp import unwrap
from pipeswap.dist.group import all_gather, broadcast_from_rank0, rank_and_world
from pipeswap.errors import PipeswapError, first_line
from pipeswap.models.blocks import find_blocks
from pipeswap.profile import LayerProfile, Profile, SavedTensor, StepMemory
from pipeswap.profiling.block_timing import BlockTiming, time_blocks
from pipeswap.profiling.meter import DeviceMeter, MemoryMarks
from pipeswap.profiling.metered_step import metered_step
from pipeswap.profiling.step import dtype_name, optimizer_state_bytes
from pipeswap.swap.config import SwapConfig
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import PlanResult, make_plan
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.capture import resolve_layers
from pipeswap.swap.runtime.checks import rank_plan
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.recompute import recompute_sizes
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.training.data_parallel import swap_topology
from pipeswap.units import format_bytes, parse_bytes

# offload()'s argument for a setting of SwapConfig that it names otherwise.
_ARGUMENT = {"gpu_memory_bytes": "gpu_memory"}
# What a forward call looks like to a plan: every tensor's shape, dtype and device, every
# other argument's value, and the autocast dtype it runs under.
Signature = tuple[Any, ...]


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


@contextmanager
def offload_names() -> Iterator[None]:
    """Refusals inside name the settings as :func:`offload` calls them (``gpu_memory``)."""
    try:
        yield
    except ConfigError as exc:
        spelled = ConfigError(exc.message)
        spelled.args = (exc.render(lambda name: _ARGUMENT.get(name, name)),)
        raise spelled from None


# A plan is made again (for less memory) at most this often when its first step held more.
_REPLANS = 2


@dataclass
class _Planned:
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
        self._takes_use_cache = "use_cache" in _parameters(self.model.forward)
        self.layers = resolve_layers(self.model, self.layer_names)
        self.optimizer_state: torch.optim.Optimizer | None = None
        self._optimizer_hooks: list[Any] = []
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer_state = optimizer
            self._optimizer_hooks = [
                optimizer.register_step_pre_hook(lambda *_: self._optimizer_step(True)),
                optimizer.register_step_post_hook(lambda *_: self._optimizer_step(False)),
            ]
            optimizer = _optimizer_name(optimizer)
        self.optimizer = optimizer
        device = self._device()
        self.check_memory = device.type == "cuda" if check_memory is None else check_memory
        self._meter: DeviceMeter | None = None  # CUDA: reading a step, to the next forward
        self._measuring: _Planned | None = None  # whose first step the meter reads
        self._step_peak_due = False  # CPU: read the next optimizer step
        self._step_meter: DeviceMeter | None = None
        self._step_peak_bytes = 0  # CPU: the optimizer step's peak, when read
        self._timings: dict[Signature, BlockTiming] = {}
        self._planned: dict[Signature, _Planned] = {}
        self._timing_hooks: list[Any] = []
        self._root_hooks: list[Any] = []
        self._inside = False  # a planning forward of our own: the hooks stand aside
        self._step: Any = None  # the executor forward in flight
        self._pending: SwapExecutor | None = None  # whose step ends at the next forward
        self._last: StepStats | None = None
        self._last_plan: _Planned | None = None
        self._timing: BlockTiming | None = None  # the timed step the meter reads
        self.steps = 0
        self.plain_steps = 0

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
        kwargs = self._without_cache(kwargs)
        self._end_pending()
        self._remove_timing()
        held_bytes = self._stop_meter()
        signature = _signature(args, kwargs, self._device())
        planned = self._planned.get(signature)
        timing = self._timings.get(signature)
        if planned is None and timing is not None and timing.complete(self.layer_names):
            planned = self._plan(signature, args, kwargs, held_bytes)
        elif planned is not None and planned.replan_due:
            planned = self._replan(signature, planned, args, kwargs)
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

    def _without_cache(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's keyword arguments with ``use_cache=False`` where the model takes it and
        the call does not say (as transformers' own gradient checkpointing does); a training
        call that asks for the cache is refused: the cache would keep the keys and values
        that the plan moves off the device or recomputes."""
        if not self._takes_use_cache:
            return kwargs
        asked = kwargs.get("use_cache")
        if asked is None:
            return {**kwargs, "use_cache": False}
        if asked:
            raise PipeswapError(
                "use_cache=True in a training forward under offload: the cache keeps every "
                "layer's keys and values on the device beyond their backward, so neither "
                "swapping nor recomputing could free them; pass use_cache=False (or leave it "
                "out: offload then passes use_cache=False, as gradient checkpointing does)"
            )
        return kwargs

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

    def _pools(self) -> list[torch.Tensor]:
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

    def _start_meter(self, planned: _Planned) -> None:
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
            self._measured(planned, peak)
        return held

    def _measured(self, planned: _Planned, peak: int) -> None:
        """A plan's first step held ``peak`` bytes: over the budget, plan again for less."""
        _, world = rank_and_world()
        if world > 1:  # every rank plans again, or none: the most any rank held
            peak = max(all_gather(peak, world))
        planned.measured_peak_bytes = peak
        excess = peak - planned.budget_bytes
        if excess > 0 and planned.replans < _REPLANS:
            planned.margin_bytes += excess
            planned.replan_due = True

    def _remove_timing(self) -> None:
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = []

    def _plan(
        self, signature: Signature, args: Any, kwargs: Any, held_bytes: int | None
    ) -> _Planned:
        """Plan this shape from its timing and one forward that names its saved tensors."""
        started = time.perf_counter()
        timing = self._timings.pop(signature)
        records, kept, rerun = self._name_tensors(args, kwargs)
        memory = timing.step_memory(self.layer_names, held_bytes)
        if memory is None:
            memory = self._metered_memory(args, kwargs)
        profile = self._profile(records, timing, args, kwargs, memory, kept, rerun)
        budget = self._budget(profile)
        result, executor = self._make(profile, budget, args, kwargs)
        planned = self._planned[signature] = _Planned(
            executor, result, profile, budget, time.perf_counter() - started
        )
        if self.check_memory and self._device().type != "cuda":
            # The storage count cannot watch the user's step: a step run aside with the
            # plan is measured, and the plan made again right away if it held more.
            while True:
                self._measured(planned, self._metered_plan(planned, args, kwargs))
                if not planned.replan_due:
                    break
                planned = self._replan(signature, planned, args, kwargs)
        return planned

    def _metered_plan(self, planned: _Planned, args: Any, kwargs: Any) -> int:
        """The storage count's peak of one forward and backward run aside with ``planned``'s
        executor (its optimizer step not included)."""
        executor = planned.executor
        self._inside = True
        try:
            _, peak = metered_step(
                self.model,
                lambda: self.model(*args, **kwargs),
                self.layers,
                self._device(),
                holding=(self.model, self.optimizer_state, args, kwargs),
                exclude=self._pools(),
                around=nullcontext if executor is None else executor.forward,
                finish=None if executor is None else executor.finish_step,
            )
        finally:
            self._inside = False
        return peak

    def _metered_memory(self, args: Any, kwargs: Any) -> StepMemory | None:
        """The storage count's readings of one forward and backward run aside (the CPU: no
        mode can watch the user's own backward), with the optimizer step read in the
        loop (or, without the optimizer, its parameters and gradients at least)."""
        self._inside = True
        try:
            timing, _ = metered_step(
                self.model,
                lambda: self.model(*args, **kwargs),
                self.layers,
                self._device(),
                holding=(self.model, self.optimizer_state, args, kwargs),
                exclude=self._pools(),
            )
        finally:
            self._inside = False
        memory = timing.step_memory(self.layer_names)
        if memory is None:
            return None
        grads = sum(
            p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad
        )
        floor = self._step_peak_bytes or memory.start_bytes + grads
        return replace(memory, step_peak_bytes=floor)

    def _name_tensors(
        self, args: Any, kwargs: Any
    ) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
        """What each layer saves (one forward as the plan names it), and what recomputing
        each layer would keep and save again (one forward with every layer wrapped for
        recomputation, as the runtime runs it)."""
        self._inside = True
        try:
            return recompute_sizes(
                self.model, self.layers, self.layer_names, lambda: self.model(*args, **kwargs)
            )
        finally:
            self._inside = False

    def _replan(self, signature: Signature, planned: _Planned, args: Any, kwargs: Any) -> _Planned:
        """Plan the shape again for ``margin_bytes`` less than its budget (a measured step
        held that much more); keeps the plan it has if none fits the smaller budget."""
        started = time.perf_counter()
        planned.replan_due = False
        target = planned.budget_bytes - planned.margin_bytes
        try:
            result, executor = self._make(planned.profile, target, args, kwargs)
        except PipeswapError as exc:
            warnings.warn(
                f"pipeswap.offload: a step held {format_bytes(planned.measured_peak_bytes or 0)}, "
                f"more than the budget of {format_bytes(planned.budget_bytes)}, and no plan "
                f"fits {format_bytes(target)} ({first_line(exc)}); keeping the plan it has",
                RuntimeWarning,
                stacklevel=4,
            )
            planned.replans = _REPLANS
            return planned
        warnings.warn(
            f"pipeswap.offload: a step held {format_bytes(planned.measured_peak_bytes or 0)}, "
            f"more than the budget of {format_bytes(planned.budget_bytes)}; planned again for "
            f"{format_bytes(target)}",
            RuntimeWarning,
            stacklevel=4,
        )
        if planned.executor is not None:
            planned.executor.close()
        replanned = self._planned[signature] = replace(
            planned,
            executor=executor,
            result=result,
            replans=planned.replans + 1,
            measured_peak_bytes=None,
            planning_s=planned.planning_s + time.perf_counter() - started,
        )
        return replanned

    def _budget(self, profile: Profile) -> int:
        """The budget in bytes: ``gpu_memory``, the measured no-swap peak / ``footprint_ratio``
        or the GPU's memory."""
        config = self.config
        if config.gpu_memory_bytes is not None:
            return config.gpu_memory_bytes
        if config.footprint_ratio is not None:
            peak = workload_from_profile(profile).no_swap_peak_bytes()
            return int(peak / config.footprint_ratio)
        _, world = rank_and_world()
        where = swap_topology(self.topology, self._device().type, world)
        return min(where.node(gpu).memory_bytes for gpu in where.gpus[:world])

    def _make(
        self, profile: Profile, budget: int, args: Any, kwargs: Any
    ) -> tuple[PlanResult, SwapExecutor | None]:
        """Rank 0's plan for ``budget`` bytes, every rank's executor for its part of it."""
        rank, world = rank_and_world()
        config = replace(self.config, gpu_memory_bytes=budget, footprint_ratio=None)

        def forward() -> Any:
            return self.model(*args, **kwargs)

        self._inside = True
        try:
            payload: Any = None
            if rank == 0:
                try:
                    where = swap_topology(self.topology, self._device().type, world)
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
                    device=self._device(),
                    account=False,
                    strict=False,  # a forward that varies (routing) swaps less, never wrongly
                )
                executor.prepare(forward)
        finally:
            self._inside = False
        return result, executor

    def _profile(
        self,
        records: dict[str, Any],
        timing: BlockTiming,
        args: Any,
        kwargs: Any,
        memory: StepMemory | None,
        kept: dict[str, int],
        rerun: dict[str, int],
    ) -> Profile:
        """The planner's view of this shape: each layer's times, saved tensors and
        parameters (those outside the layers count with the first, as resident memory), and
        what the meter read during the timed step."""
        seen: set[int] = set()
        params: dict[str, int] = {}
        for name, layer in self.layers.items():
            params[name] = _new_bytes(layer.parameters(), seen)
        outside = _new_bytes(self.model.parameters(), seen)
        params[self.layer_names[0]] += outside
        backward_s = timing.backward_s(self.layer_names)
        layers = tuple(
            LayerProfile(
                name=name,
                forward_s=timing.forward_s[name],
                backward_s=backward_s[name],
                param_bytes=params[name],
                output_bytes=timing.output_bytes.get(name, 0),
                saved=tuple(SavedTensor(r.index, r.bytes) for r in records[name]),
                kept_bytes=kept.get(name),
                rerun_bytes=rerun.get(name),
            )
            for name in self.layer_names
        )
        first = next(
            (t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), None
        )
        total = sum(params.values())
        dtype = next(self.model.parameters()).dtype
        return Profile(
            model=_model_name(self.model),
            batch=int(first.shape[0]) if first is not None and first.dim() else 1,
            dtype=dtype_name(dtype),
            source="measured",
            device=self._device().type,
            optimizer=self.optimizer,
            optimizer_state_bytes=optimizer_state_bytes(self.optimizer, total),
            layers=layers,
            notes={"source": "pipeswap.offload: one step of the user's loop, timed by hooks"},
            memory=memory,
        )

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


def _signature(args: Any, kwargs: Any, device: torch.device) -> Signature:
    leaves, spec = tree_flatten((args, kwargs))
    shape = tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else repr(x)
        for x in leaves
    )
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return (str(spec), shape, cast)


def _optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's name as the state model knows it (adam, adamw or sgd)."""
    name = type(optimizer).__name__.lower()
    return name if name in ("adam", "adamw", "sgd") else "adamw"


def _parameters(function: Any) -> Any:
    try:
        return inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin or C function: it names no parameters
        return {}


def _new_bytes(params: Any, seen: set[int]) -> int:
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _model_name(model: nn.Module) -> str:
    name = getattr(model, "name", None)
    return name if isinstance(name, str) else type(model).__name__
