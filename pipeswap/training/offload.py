"""offload(model): a model's saved tensors swapped to host memory inside your own training loop."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.config import ConfigError
from pipeswap.dist.ddp import unwrap
from pipeswap.dist.group import broadcast_from_rank0, rank_and_world
from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import find_blocks
from pipeswap.profile import LayerProfile, Profile, SavedTensor
from pipeswap.profiling.step import dtype_name, optimizer_state_bytes
from pipeswap.swap.config import SwapConfig
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.plan.planner import PlanResult, make_plan
from pipeswap.swap.runtime.capture import capture_records, resolve_layers
from pipeswap.swap.runtime.checks import rank_plan
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.training.block_timing import BlockTiming, time_blocks
from pipeswap.training.data_parallel import swap_topology
from pipeswap.units import parse_bytes

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
    optimizer: str = "adamw",
    time_limit_s: float = 10.0,
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
    model's repeated block list); ``optimizer`` says which state the budget counts.
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
    return Offload(model, config, layers=layers, optimizer=optimizer, topology=topology)


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
class _Planned:
    """A shape's plan, and its executor (None when the plan moves nothing: no overhead)."""

    executor: SwapExecutor | None
    result: PlanResult


class Offload:
    """The reusable context manager :func:`offload` returns (see there)."""

    def __init__(
        self,
        model: nn.Module,
        config: SwapConfig,
        *,
        layers: Sequence[str] | None = None,
        optimizer: str = "adamw",
        topology: str | None = None,
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
        self.layers = resolve_layers(self.model, self.layer_names)
        self.optimizer = optimizer
        self._timings: dict[Signature, BlockTiming] = {}
        self._planned: dict[Signature, _Planned] = {}
        self._timing_hooks: list[Any] = []
        self._root_hooks: list[Any] = []
        self._inside = False  # a planning forward of our own: the hooks stand aside
        self._step: Any = None  # the executor forward in flight
        self._pending: SwapExecutor | None = None  # whose step ends at the next forward
        self._last: StepStats | None = None
        self._last_plan: PlanResult | None = None
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
        for planned in self._planned.values():
            if planned.executor is not None:
                planned.executor.close()
        self._planned.clear()

    # ---- hooks on the model's own call ----------------------------------------------
    def _before(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._inside or not torch.is_grad_enabled():
            return
        self._end_pending()
        self._remove_timing()
        signature = _signature(args, kwargs, self._device())
        planned = self._planned.get(signature)
        timing = self._timings.get(signature)
        if planned is None and timing is not None and timing.complete(self.layer_names):
            planned = self._plan(signature, args, kwargs)
        if planned is None:
            self._start_timing(signature)
            self.plain_steps += 1
            return
        self._last_plan = planned.result
        executor = planned.executor
        if executor is None:
            self.steps += 1
            self._last = None
            return
        offset = executor.gpu_plan.offset_s
        if offset > 0:  # this rank starts later, so its swaps meet its neighbour's fetches
            if executor.device.type == "cuda":
                torch.cuda.synchronize(executor.device)
            time.sleep(offset)
        self._step = executor.forward()
        self._step.__enter__()
        self._pending = executor

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

    def _start_timing(self, signature: Signature) -> None:
        timing = self._timings[signature] = BlockTiming()
        self._timing_hooks = time_blocks(self.layers, timing, self._device())

    def _remove_timing(self) -> None:
        for handle in self._timing_hooks:
            handle.remove()
        self._timing_hooks = []

    def _plan(self, signature: Signature, args: Any, kwargs: Any) -> _Planned:
        """Plan this shape from its timing and one forward that names its saved tensors."""
        timing = self._timings.pop(signature)
        rank, world = rank_and_world()

        def forward() -> Any:
            return self.model(*args, **kwargs)

        self._inside = True
        try:
            records, _ = capture_records(self.model, forward, self.layer_names)
            profile = self._profile(records, timing, args, kwargs)
            payload: Any = None
            if rank == 0:
                try:
                    where = swap_topology(self.topology, self._device().type, world)
                    result = make_plan(profile, where, self.config, gpus=world)
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
        planned = self._planned[signature] = _Planned(executor, result)
        return planned

    def _profile(
        self, records: dict[str, Any], timing: BlockTiming, args: Any, kwargs: Any
    ) -> Profile:
        """The planner's view of this shape: each layer's times, saved tensors and
        parameters (those outside the layers count with the first, as resident memory)."""
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
        )

    # ---- what it did ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What the last step did and the plan it ran: bytes swapped and recomputed, late
        fetches, the plan's policy and its predicted step and stall (call it after a
        step's backward)."""
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
        if self._last_plan is not None:
            result = self._last_plan
            out["policy"] = result.policy
            out["predicted_step_s"] = result.iteration_s
            out["predicted_stall_s"] = max(0.0, result.iteration_s - result.compute_s)
            out["budget_bytes"] = result.budget_bytes
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
