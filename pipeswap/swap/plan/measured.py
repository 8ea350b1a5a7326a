"""What a Profile says, in the Workload's terms: measured memory, recomputation's inputs,
selective recomputation, the optimizer step's time."""

from __future__ import annotations

from typing import Any, NamedTuple

from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.profiling.profile import Profile

__all__ = [
    "MeasuredMemory",
    "estimated_optimizer_step_s",
    "gradients_held",
    "measured_memory",
    "output_gradients",
    "recomputed_inputs",
    "selective_fields",
]


class MeasuredMemory(NamedTuple):
    """The Workload's memory fields from what a meter read (see :func:`measured_memory`)."""

    resident_bytes: int
    transient: tuple[int, ...]
    backward_transient: tuple[int, ...]
    turn_bytes: int
    floor_bytes: int


def measured_memory(profile: Profile) -> MeasuredMemory:
    """The Workload's memory fields from what the meter read (``profile.memory``): each
    point's reading less the resident bytes and the saved tensors of the layers up to it,
    so that with nothing swapped every point of the Workload is the reading itself (never
    less: a negative remainder counts as 0). The turn comes after the last forward, before
    a swap-out issued there has landed: it counts at the last layer's forward point."""
    memory = profile.memory
    assert memory is not None
    start = memory.start_bytes
    cumulative = []
    total = 0
    for layer in profile.layers:
        total += layer.saved_bytes
        cumulative.append(total)
    forward = tuple(
        max(0, peak - start - held) for peak, held in zip(memory.forward_peak_bytes, cumulative)
    )
    backward = tuple(
        max(0, peak - start - held) for peak, held in zip(memory.backward_peak_bytes, cumulative)
    )
    turn = max(0, memory.turn_peak_bytes - start - cumulative[-1])
    return MeasuredMemory(start, forward, backward, turn, memory.step_peak_bytes)


def gradients_held(profile: Profile) -> tuple[int, ...]:
    """Per layer: the gradients held when its backward starts, beyond what the meter read
    at the step's start (a recomputed layer's re-run holds them beside its own working
    set): those of the layers after it and of the parameters outside the layers, which a
    profile counts with the first layer (its bytes beyond the smallest other layer's; all
    of them counted: the embeddings' too, on the safe side). Empty where the meter read
    nothing, or read the gradients at the start (a loop that keeps them between steps)."""
    memory, layers = profile.memory, profile.layers
    if memory is None or memory.start_bytes >= profile.resident_bytes:
        return ()
    own = [layer.param_bytes for layer in layers]
    outside = own[0] - min(own[1:]) if len(own) > 1 else 0
    return tuple(max(0, outside) + sum(own[i + 1 :]) for i in range(len(own)))


def output_gradients(profile: Profile) -> tuple[int, ...]:
    """Per layer: what its re-run holds for its output beyond what it saves and its
    forward's working set as the meter read it (``rerun_output_bytes``: the output's
    gradient, pipeswap.swap.runtime.capture.InnerSaves.output_bytes). Empty where the
    re-run was not measured or the meter read nothing (an estimate's working set is its
    output and workspace)."""
    layers = profile.layers
    if profile.memory is None or any(layer.rerun_output_bytes is None for layer in layers):
        return ()
    return tuple(layer.rerun_output_bytes or 0 for layer in layers)


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def recomputed_inputs(profile: Profile) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per layer: the bytes recomputing it keeps (its input) and the bytes of its saved
    tensor that is that input (0 if it saves no tensor of that size).

    Measured profiles say both per layer (``kept_bytes``, ``rerun_bytes``). Otherwise
    layer i > 0 keeps the previous layer's output. Layer 0 keeps the batch, which the
    accounting counts only where layer 0 saves it: the batch is images (3 channels in the
    profile's dtype) or token ids (int64), recognised among layer 0's saved tensors by size.
    """
    layers = profile.layers
    if all(layer.kept_bytes is not None and layer.rerun_bytes is not None for layer in layers):
        # Measured as the runtime recomputes: kept, and saved less what the re-run saves
        # (negative where the re-run saves more than a step keeps: the casts a step keeps
        # once, torch's checkpoint keeps each time; the Workload's re-run is then exact).
        return (
            tuple(layer.kept_bytes or 0 for layer in layers),
            tuple(layer.saved_bytes - (layer.rerun_bytes or 0) for layer in layers),
        )
    itemsize = _DTYPE_BYTES.get(profile.dtype, 4)
    batch_sizes = set()
    if profile.image_size:
        batch_sizes.add(profile.batch * 3 * profile.image_size**2 * itemsize)
    if profile.seq_len:
        batch_sizes.add(profile.batch * profile.seq_len * 8)
    first = next((t.bytes for t in layers[0].saved if t.bytes in batch_sizes), 0)
    kept = [first] + [layer.output_bytes for layer in layers[:-1]]
    saved_input = [
        next((t.bytes for t in layer.saved if t.bytes == kept[i] and kept[i] > 0), 0)
        for i, layer in enumerate(layers)
    ]
    return tuple(kept), tuple(saved_input)


def estimated_optimizer_step_s(profile: Profile) -> float:
    if profile.optimizer_step_s is not None:
        return profile.optimizer_step_s  # timed by pipeswap.measure
    # The step streams parameters, gradients and optimizer state through HBM once; without
    # a known GPU (a measured CPU profile) it is left out rather than guessed.
    try:
        spec = gpu_spec(profile.device)
    except PipeswapError:
        return 0.0
    touched = 4 * profile.param_bytes + 2 * profile.optimizer_state_bytes
    return touched / spec.hbm_bytes_per_s


def selective_fields(profile: Profile) -> dict[str, Any]:
    """The Workload's selective fields, where the profile measured every layer's."""
    layers = profile.layers
    if any(
        layer.selective_kept_bytes is None
        or layer.selective_rerun_bytes is None
        or layer.selective_rerun_s is None
        for layer in layers
    ):
        return {}
    return {
        "selective_kept": tuple(layer.selective_kept_bytes or 0 for layer in layers),
        "selective_rerun": tuple(layer.selective_rerun_bytes or 0 for layer in layers),
        "selective_s": tuple(layer.selective_rerun_s or 0.0 for layer in layers),
    }
