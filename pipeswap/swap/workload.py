"""One data-parallel training iteration as a task graph: compute, swaps, all-reduce, step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from pipeswap.errors import PipeswapError
from pipeswap.profile import Profile
from pipeswap.sim.graph import GraphBuilder, TaskGraph

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class Swap:
    """A swap in index form: layer ``layer``'s saved tensor ``index``.

    The swap-out is issued after forward ``out`` (>= layer); the prefetch after backward
    ``prefetch`` (in layer+1 .. L-1), or at the turn when ``prefetch == L``.
    """

    layer: int
    index: int
    bytes: int
    out: int
    prefetch: int


@dataclass(frozen=True)
class Workload:
    """The per-layer numbers of one micro-batch that planning needs, from a Profile."""

    model: str
    names: tuple[str, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    saved: tuple[tuple[tuple[int, int], ...], ...]  # per layer: (index, bytes)
    transient: tuple[int, ...]  # working memory while the layer runs, forward or backward
    param_bytes: tuple[int, ...]
    resident_bytes: int  # parameters, gradients, optimizer state
    optimizer_step_s: float

    @property
    def num_layers(self) -> int:
        return len(self.names)

    @cached_property
    def saved_bytes(self) -> tuple[int, ...]:
        # Cached: graph building asks for it per task (frozen dataclasses allow this).
        return tuple(sum(b for _, b in layer) for layer in self.saved)

    @property
    def microbatch_s(self) -> float:
        return sum(self.forward_s) + sum(self.backward_s)

    def compute_s(self, sync_every: int) -> float:
        """Compute time of one iteration on one GPU: K micro-batches and the optimizer step."""
        return sync_every * self.microbatch_s + self.optimizer_step_s

    def no_swap_peak_bytes(self) -> int:
        """Peak memory with nothing swapped: the largest forward (= backward) point."""
        cumulative = 0
        peak = 0
        for saved, transient in zip(self.saved_bytes, self.transient):
            cumulative += saved
            peak = max(peak, cumulative + transient)
        return self.resident_bytes + peak

    def min_budget_bytes(self) -> int:
        """What can never be swapped: resident state and the largest layer's working set."""
        working = max(s + t for s, t in zip(self.saved_bytes, self.transient))
        return self.resident_bytes + working

    def needs(self, budget_bytes: int) -> list[int]:
        """``needs[i]``: bytes of layers before i that must be off the GPU while layer i runs.

        A plan fits (with prefetches issued as late as possible) iff, for every i, its
        swapped bytes of layers < i, swapped out before forward i, are at least needs[i].
        """
        out: list[int] = []
        cumulative = 0
        for saved, transient in zip(self.saved_bytes, self.transient):
            cumulative += saved
            out.append(max(0, self.resident_bytes + cumulative + transient - budget_bytes))
        return out

    def memory_points(self, swaps: Sequence[Swap]) -> tuple[list[int], list[int]]:
        """Worst-case memory while each forward and each backward runs, per layer.

        Counts a swapped tensor as gone once its swap-out was issued before the forward
        (the simulator makes the forward wait for the copy to finish) and as back once
        its prefetch was issued before the backward (the copy may have taken its memory).
        A plan whose points are all within the budget can never deadlock in simulation.
        """
        n = self.num_layers
        gone_before = [0] * (n + 1)  # bytes whose swap-out is issued before forward i
        # On host during backward j (j >= prefetch): its prefetch is issued after backward
        # ``prefetch``, which comes later than backward j only when prefetch <= j.
        on_host = [0] * (n + 1)
        for s in swaps:
            gone_before[s.out + 1] += s.bytes
            on_host[s.prefetch] += s.bytes
        forward: list[int] = []
        backward: list[int] = []
        cumulative = gone = host = 0
        for i in range(n):
            cumulative += self.saved_bytes[i]
            gone += gone_before[i]
            host += on_host[i]
            forward.append(self.resident_bytes + cumulative - gone + self.transient[i])
            backward.append(self.resident_bytes + cumulative - host + self.transient[i])
        return forward, backward

    def fits(self, swaps: Sequence[Swap], budget_bytes: int) -> bool:
        forward, backward = self.memory_points(swaps)
        return max(forward) <= budget_bytes and max(backward) <= budget_bytes


def workload_from_profile(profile: Profile, *, optimizer_step_s: float | None = None) -> Workload:
    """The planning view of ``profile``; refuses profiles without saved-tensor data."""
    missing = [layer.name for layer in profile.layers if not layer.saved]
    if not profile.layers:
        raise PipeswapError(f"the profile of {profile.model} has no layers")
    if not profile.has_saved_data or len(missing) == len(profile.layers):
        raise PipeswapError(
            f"the profile of {profile.model} has no saved-tensor data, which swap planning "
            "needs; make one with `pipeswap profile --model "
            f"{profile.model} --batch {profile.batch} --estimate --gpu v100-32gb --out p.json` "
            "(or measure it without --estimate)"
        )
    if optimizer_step_s is None:
        optimizer_step_s = _optimizer_step_s(profile)
    return Workload(
        model=profile.model,
        names=tuple(profile.layer_names),
        forward_s=tuple(layer.forward_s for layer in profile.layers),
        backward_s=tuple(layer.backward_s for layer in profile.layers),
        saved=tuple(tuple((t.index, t.bytes) for t in layer.saved) for layer in profile.layers),
        transient=tuple(layer.workspace_bytes + layer.output_bytes for layer in profile.layers),
        param_bytes=tuple(layer.param_bytes for layer in profile.layers),
        resident_bytes=profile.resident_bytes,
        optimizer_step_s=optimizer_step_s,
    )


def _optimizer_step_s(profile: Profile) -> float:
    # The step streams parameters, gradients and optimizer state through HBM once; without
    # a known GPU (a measured CPU profile) it is left out rather than guessed.
    try:
        from pipeswap.hardware.gpus import gpu_spec

        spec = gpu_spec(profile.device)
    except (ImportError, PipeswapError):
        return 0.0
    touched = 4 * profile.param_bytes + 2 * profile.optimizer_state_bytes
    return touched / spec.hbm_bytes_per_s


def gradient_buckets(workload: Workload, bucket_bytes: int) -> list[tuple[int, int]]:
    """DDP-style buckets in backward order: (bytes, the layer whose backward closes it)."""
    buckets: list[tuple[int, int]] = []
    filled = 0
    for layer in reversed(range(workload.num_layers)):
        filled += workload.param_bytes[layer]
        if filled >= bucket_bytes or layer == 0:
            if filled > 0:
                buckets.append((filled, layer))
            filled = 0
    return buckets


def build_iteration_graph(
    workload: Workload,
    gpus: Sequence[str],
    swaps: Mapping[str, Sequence[Swap]],
    *,
    offsets_s: Mapping[str, float] | None = None,
    sync_every: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TaskGraph:
    """The task graph of one iteration (``sync_every`` micro-batches) on every GPU.

    Task ids are ``{gpu}/m{micro}/f{layer}`` (forward), ``.../b{layer}`` (backward),
    ``.../out{layer}.{index}`` and ``.../in{layer}.{index}`` (one copy per saved tensor,
    as the executor copies them), ``{gpu}/offset``, ``{gpu}/resident``, ``{gpu}/step`` and ``allreduce{k}``.
    """
    if sync_every < 1:
        raise PipeswapError(f"--sync-every is {sync_every}; use 1 or more")
    offsets_s = offsets_s or {}
    builder = GraphBuilder()
    last_backward: dict[str, list[str]] = {}
    for gpu in gpus:
        plan = list(swaps.get(gpu, ()))
        previous = builder.compute(
            gpu, 0.0, alloc_bytes=workload.resident_bytes, id=f"{gpu}/resident"
        )
        offset = offsets_s.get(gpu, 0.0)
        if offset > 0:
            # An offset GPU simply starts later; its compute stream idles meanwhile.
            previous = builder.compute(gpu, offset, deps=[previous], id=f"{gpu}/offset")
        for micro in range(sync_every):
            previous, backward_ids = _microbatch(builder, workload, gpu, micro, plan, previous)
        last_backward[gpu] = backward_ids
    reduce_ids: list[str] = []
    if len(gpus) > 1:
        for k, (nbytes, layer) in enumerate(gradient_buckets(workload, bucket_bytes)):
            deps = [last_backward[gpu][layer] for gpu in gpus]
            reduce_ids.append(builder.allreduce(gpus, nbytes, deps=deps, id=f"allreduce{k}"))
    for gpu in gpus:
        builder.compute(
            gpu,
            workload.optimizer_step_s,
            deps=[last_backward[gpu][0], *reduce_ids],
            free_bytes=workload.resident_bytes,
            id=f"{gpu}/step",
        )
    return builder.build()


def _microbatch(
    builder: GraphBuilder,
    workload: Workload,
    gpu: str,
    micro: int,
    plan: Sequence[Swap],
    previous: str,
) -> tuple[str, list[str]]:
    n = workload.num_layers
    prefix = f"{gpu}/m{micro}"
    # One copy per tensor, as the executor issues them: at each point, later layers first,
    # then by saved index (the copy engines are FIFO, so this order is part of the plan).
    outs: dict[int, list[Swap]] = {}
    ins: dict[int, list[Swap]] = {}
    for s in sorted(plan, key=lambda s: (-s.layer, s.index)):
        outs.setdefault(s.out, []).append(s)
        ins.setdefault(s.prefetch, []).append(s)
    out_ids: dict[tuple[int, int], str] = {}
    for i in range(n):
        transient = workload.transient[i]
        previous = builder.compute(
            gpu,
            workload.forward_s[i],
            deps=[previous],
            alloc_bytes=workload.saved_bytes[i] + transient,
            free_bytes=transient,
            id=f"{prefix}/f{i}",
        )
        for s in outs.get(i, ()):
            out_ids[(s.layer, s.index)] = builder.d2h(
                gpu, s.bytes, deps=[previous], free_bytes=s.bytes,
                id=f"{prefix}/out{s.layer}.{s.index}",
            )
    in_ids: dict[int, list[str]] = {}
    backward_ids = [""] * n
    for j in reversed(range(n)):
        # Prefetches issued after backward j+1 (or after the last forward when j+1 == n).
        for s in ins.get(j + 1, ()):
            task_id = builder.h2d(
                gpu,
                s.bytes,
                deps=[previous, out_ids[(s.layer, s.index)]],
                alloc_bytes=s.bytes,
                id=f"{prefix}/in{s.layer}.{s.index}",
            )
            in_ids.setdefault(s.layer, []).append(task_id)
        transient = workload.transient[j]
        previous = builder.compute(
            gpu,
            workload.backward_s[j],
            deps=[previous, *in_ids.get(j, [])],
            alloc_bytes=transient,
            free_bytes=transient + workload.saved_bytes[j],
            id=f"{prefix}/b{j}",
        )
        backward_ids[j] = previous
    return previous, backward_ids


def swap_sizes(workload: Workload) -> dict[tuple[int, int], int]:
    """Every saved tensor as (layer, index) -> bytes."""
    return {
        (layer, index): nbytes
        for layer, tensors in enumerate(workload.saved)
        for index, nbytes in tensors
    }
