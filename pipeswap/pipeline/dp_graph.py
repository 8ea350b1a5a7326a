"""Data-parallel training as a task graph: the baseline pipelines are compared against.

Every GPU holds the whole model and runs forward and backward of its own batch (the
profile's batch) layer by layer; the gradients are summed with ring allreduces. Like
PyTorch DDP, gradients are grouped into buckets in backward order (25 MiB by default):
a bucket's allreduce starts on the GPUs' communication stream as soon as every GPU has
run the backward of the bucket's last layer, so communication overlaps the rest of the
backward. ``bucket_bytes=None`` reduces all gradients in one allreduce after the
backward (no overlap). The optimizer update waits for every bucket; the next step's
forward waits for the update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.hardware.topology import Topology
from pipeswap.profile import Profile

GRAPH_FORMAT = "pipeswap.graph/1"
DDP_BUCKET_BYTES = 25 * 2**20


def gradient_buckets(profile: Profile, bucket_bytes: int | None) -> list[tuple[int, ...]]:
    """Layer indices of each bucket, in the order backward fills them (last layer first).

    A bucket closes once its gradients reach ``bucket_bytes``; layers without parameters
    join no bucket. ``None`` puts every layer with parameters in one bucket.
    """
    if bucket_bytes is not None and bucket_bytes < 1:
        raise PipeswapError(f"bucket_bytes must be positive (or None), not {bucket_bytes}")
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    filled = 0
    for index in reversed(range(len(profile.layers))):
        size = profile.layers[index].param_bytes
        if size == 0:
            continue
        current.append(index)
        filled += size
        if bucket_bytes is not None and filled >= bucket_bytes:
            buckets.append(tuple(current))
            current, filled = [], 0
    if current:
        buckets.append(tuple(current))
    return buckets


def data_parallel_task_graph(
    profile: Profile,
    topology: Topology,
    *,
    gpus: Sequence[str] | None = None,
    steps: int = 1,
    bucket_bytes: int | None = DDP_BUCKET_BYTES,
    update_s: float = 0.0,
) -> dict[str, Any]:
    """``steps`` data-parallel iterations of ``profile`` on ``gpus`` (default: all of them).

    Task ids: ``{gpu}:init`` (zero time; holds weights, gradients and optimizer state),
    ``{gpu}:F{step}.{layer}`` (allocates the layer's saved tensors),
    ``{gpu}:B{step}.{layer}`` (frees them), ``AR{step}.{bucket}`` (ring allreduce of the
    bucket's gradient bytes over ``gpus``, in that ring order) and ``{gpu}:U{step}``
    (the optimizer update, ``update_s`` long).
    """
    if steps < 1:
        raise PipeswapError(f"steps must be at least 1, not {steps}")
    placement = list(gpus) if gpus is not None else list(topology.gpus)
    if not placement:
        raise PipeswapError(f"topology {topology.name} has no GPUs to run data parallelism on")
    unknown = [g for g in placement if g not in topology.gpus]
    if unknown:
        raise PipeswapError(
            f"{', '.join(unknown)} not in topology {topology.name}; its GPUs: "
            f"{', '.join(topology.gpus)}"
        )
    layers = profile.layers
    buckets = gradient_buckets(profile, bucket_bytes)
    closes = {bucket[-1]: b for b, bucket in enumerate(buckets)}
    tasks: list[dict[str, Any]] = []
    previous = {gpu: f"{gpu}:init" for gpu in placement}
    for gpu in placement:
        tasks.append({"id": f"{gpu}:init", "kind": "compute", "gpu": gpu, "duration_s": 0.0,
                      "alloc_bytes": profile.resident_bytes})  # fmt: skip
    for step in range(steps):
        for gpu in placement:
            for index, layer in enumerate(layers):
                task_id = f"{gpu}:F{step}.{index}"
                tasks.append(_compute(task_id, gpu, layer.forward_s, previous[gpu],
                                      alloc_bytes=layer.saved_bytes))  # fmt: skip
                previous[gpu] = task_id
        # Backward in layer order, GPU by GPU; each bucket's allreduce is listed as soon
        # as its last layer's backward is, so comm streams run buckets in backward order.
        reduces = []
        for index in reversed(range(len(layers))):
            layer = layers[index]
            for gpu in placement:
                task_id = f"{gpu}:B{step}.{index}"
                tasks.append(_compute(task_id, gpu, layer.backward_s, previous[gpu],
                                      free_bytes=layer.saved_bytes))  # fmt: skip
                previous[gpu] = task_id
            if index in closes:
                bucket = buckets[closes[index]]
                reduce_id = f"AR{step}.{closes[index]}"
                tasks.append({
                    "id": reduce_id, "kind": "allreduce", "gpus": placement,
                    "bytes": sum(layers[i].param_bytes for i in bucket),
                    "deps": [f"{gpu}:B{step}.{index}" for gpu in placement],
                })  # fmt: skip
                reduces.append(reduce_id)
        for gpu in placement:
            task_id = f"{gpu}:U{step}"
            task = _compute(task_id, gpu, update_s, previous[gpu])
            task["deps"] += reduces
            tasks.append(task)
            previous[gpu] = task_id
    return {"format": GRAPH_FORMAT, "tasks": tasks}


def data_parallel_graph(*args: Any, **kwargs: Any) -> Any:
    """:func:`data_parallel_task_graph` as a ``pipeswap.sim.graph.TaskGraph``."""
    from pipeswap.sim.graph import TaskGraph

    return TaskGraph.from_json(data_parallel_task_graph(*args, **kwargs))


def _compute(
    task_id: str, gpu: str, duration_s: float, previous: str, *, alloc_bytes: int = 0,
    free_bytes: int = 0,
) -> dict[str, Any]:  # fmt: skip
    task: dict[str, Any] = {"id": task_id, "kind": "compute", "gpu": gpu,
                            "duration_s": duration_s, "deps": [previous]}  # fmt: skip
    if alloc_bytes:
        task["alloc_bytes"] = alloc_bytes
    if free_bytes:
        task["free_bytes"] = free_bytes
    return task
