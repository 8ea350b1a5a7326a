"""One data-parallel iteration as a task graph: compute, swaps, recompute, all-reduce, step."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from pipeswap.errors import PipeswapError
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.graph import TaskGraph
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import Workload
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES

__all__ = ["Bucket", "buckets_of", "build_iteration_graph", "gradient_buckets"]


class Bucket(NamedTuple):
    """One DDP gradient bucket: its bytes and the layer whose backward completes it."""

    bytes: int
    layer: int


def gradient_buckets(workload: Workload, bucket_bytes: int | None) -> list[Bucket]:
    """DDP-style buckets in the order backward fills them (last layer first).

    A bucket closes once its gradients reach ``bucket_bytes``; its all-reduce may start
    after the backward of the last layer it took (its lowest layer with parameters).
    Layers without parameters join no bucket. ``None`` puts every gradient in one bucket;
    a size is positive (SwapConfig checks ``bucket_bytes``).
    """
    return buckets_of(workload.param_bytes, bucket_bytes)


def buckets_of(param_bytes: Sequence[int], bucket_bytes: int | None) -> list[Bucket]:
    """:func:`gradient_buckets` of layers with these parameter bytes (in forward order)."""
    buckets: list[Bucket] = []
    filled = 0
    closer = -1  # the lowest layer with parameters in the open bucket
    for layer in reversed(range(len(param_bytes))):
        size = param_bytes[layer]
        if size == 0:
            continue
        filled += size
        closer = layer
        if bucket_bytes is not None and filled >= bucket_bytes:
            buckets.append(Bucket(filled, layer))
            filled = 0
    if filled:
        buckets.append(Bucket(filled, closer))
    return buckets


def build_iteration_graph(
    workload: Workload,
    gpus: Sequence[str],
    swaps: Mapping[str, Sequence[SwapDecisionAt]] | None = None,
    *,
    offsets_s: Mapping[str, float] | None = None,
    recompute: Mapping[str, Collection[int]] | None = None,
    sync_every: int = 1,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    steps: int = 1,
) -> TaskGraph:
    """``steps`` data-parallel iterations of ``sync_every`` micro-batches on every GPU.

    Each GPU holds the whole model and runs forward and backward of every micro-batch
    layer by layer, with the ``swaps`` of its plan (none by default); a GPU with an offset
    in ``offsets_s`` idles that long at the start of every iteration, and a GPU recomputes
    the layers ``recompute`` names for it (the memory model of :class:`Workload`: a
    task ``.../r{layer}`` runs the layer's forward again right before its backward).
    Gradients are summed
    by ring all-reduces over ``gpus`` (in that ring order), one per
    :func:`gradient_buckets` bucket, each started on the GPUs' comm streams once every GPU
    has run the backward that completes it, so communication overlaps the rest of the
    backward (``bucket_bytes=None``: one all-reduce after the backward). The optimizer
    step (``workload.optimizer_step_s``) waits for every all-reduce; the next iteration's
    forward waits for the step.

    Task ids are ``{gpu}/m{micro}/f{layer}`` (forward), ``.../b{layer}`` (backward),
    ``.../r{layer}`` (a recomputed layer's second forward),
    ``.../out{layer}.{index}`` and ``.../in{layer}.{index}`` (one copy per saved tensor,
    as the executor copies them), ``{gpu}/offset``, ``{gpu}/resident`` (zero time; holds
    parameters, gradients and optimizer state), ``{gpu}/step`` and ``allreduce{k}``.
    Iterations after the first repeat these ids with ``s{step}/`` after the GPU
    (``gpu0/s1/m0/f0``, ``gpu0/s1/step``; ``s1/allreduce0``).
    """
    if steps < 1:
        raise PipeswapError(f"steps must be at least 1, not {steps}")
    swaps = swaps or {}
    offsets_s = offsets_s or {}
    recompute = recompute or {}
    buckets = gradient_buckets(workload, bucket_bytes) if len(gpus) > 1 else []
    builder = GraphBuilder()
    previous: dict[str, str] = {}
    for step in range(steps):
        tag = f"s{step}/" if step else ""
        last_backward: dict[str, list[str]] = {}
        for gpu in gpus:
            if step == 0:
                previous[gpu] = builder.compute(
                    gpu, 0.0, alloc_bytes=workload.resident_bytes, id=f"{gpu}/resident"
                )
            plan = list(swaps.get(gpu, ()))
            offset = offsets_s.get(gpu, 0.0)
            if offset > 0:
                # An offset GPU simply starts later; its compute stream idles meanwhile.
                previous[gpu] = builder.compute(
                    gpu, offset, deps=[previous[gpu]], id=f"{gpu}/{tag}offset"
                )
            view = workload.recomputing(recompute.get(gpu, ()))
            for micro in range(sync_every):
                previous[gpu], last_backward[gpu] = _microbatch(
                    builder, view, f"{gpu}/{tag}m{micro}", gpu, plan, previous[gpu]
                )
        reduce_ids = []
        for k, bucket in enumerate(buckets):
            deps = [last_backward[gpu][bucket.layer] for gpu in gpus]
            reduce_ids.append(
                builder.allreduce(gpus, bucket.bytes, deps=deps, id=f"{tag}allreduce{k}")
            )
        last = step == steps - 1
        # The step's own peak (measured profiles): held while it runs, above resident state.
        step_extra = max(0, workload.floor_bytes - workload.resident_bytes)
        for gpu in gpus:
            previous[gpu] = builder.compute(
                gpu,
                workload.optimizer_step_s,
                deps=[last_backward[gpu][0], *reduce_ids],
                alloc_bytes=step_extra,
                free_bytes=step_extra + (workload.resident_bytes if last else 0),
                id=f"{gpu}/{tag}step",
            )
    return builder.build()


def _microbatch(
    builder: GraphBuilder,
    workload: Workload,
    prefix: str,
    gpu: str,
    plan: Sequence[SwapDecisionAt],
    previous: str,
) -> tuple[str, list[str]]:
    n = workload.num_layers
    # One copy per tensor, as the executor issues them: at each point, later layers first,
    # then by saved index (the copy engines are FIFO, so this order is part of the plan).
    outs: dict[int, list[SwapDecisionAt]] = {}
    ins: dict[int, list[SwapDecisionAt]] = {}
    for s in sorted(plan, key=lambda s: (-s.layer, s.index)):
        outs.setdefault(s.out, []).append(s)
        ins.setdefault(s.prefetch, []).append(s)
    out_ids: dict[tuple[int, int], str] = {}
    for i in range(n):
        transient = workload.forward_working[i]
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
                gpu,
                s.bytes,
                deps=[previous],
                free_bytes=s.bytes,
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
        transient = workload.rerun_working[j]
        again = workload.recompute_bytes[j]
        if j in workload.recompute:
            # The layer's forward again (its recomputation): its saved tensors stay for
            # the backward, its working set (over the gradients made so far) goes when it
            # ends.
            previous = builder.compute(
                gpu,
                workload.rerun_s[j],
                deps=[previous],
                alloc_bytes=again + transient,
                free_bytes=transient,
                id=f"{prefix}/r{j}",
            )
        working = workload.backward_working[j]
        previous = builder.compute(
            gpu,
            workload.backward_s[j],
            deps=[previous, *in_ids.get(j, [])],
            alloc_bytes=working,
            free_bytes=working + workload.saved_bytes[j] + again,
            id=f"{prefix}/b{j}",
        )
        backward_ids[j] = previous
    return previous, backward_ids
