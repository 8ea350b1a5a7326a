"""Per-stage, per-unit costs of a cut model: compute, resident memory, what each layer saves."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeswap.errors import PipeswapError
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import schedule_kind
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.partition import stage_bounds
from pipeswap.swap.plan.workload import workload_from_profile

__all__ = ["StageCosts", "stage_costs"]


@dataclass(frozen=True)
class StageCosts:
    """What one unit (micro- or mini-batch) costs on stage ``stage``.

    ``layers`` are the model's layer indices on the stage; the per-layer tuples follow
    them. ``saved``: bytes a layer keeps from its forward to its backward; ``kept``: what
    it keeps instead when it is recomputed (its input, :class:`Workload`'s model) and
    ``rerun``: what its second forward allocates right before the backward.
    ``resident_bytes``: weights, gradients, the optimizer's share and the weight mode's
    extra copies, held for the whole run; ``transient_bytes``: the largest working set
    of one of its layers, held while a pass runs. ``in_flight``: units whose activations
    the schedule keeps on the stage at once.

    Measured on the stage itself
    (:func:`pipeswap.training.pipeline_stage_swaps.measured_stage_costs`), three more: what a unit
    holds beyond its layers' saved tensors (``unit_extra_bytes``: its input, outputs),
    a backward's working set (``backward_transient_bytes``; None: ``transient_bytes``)
    and an update's (``update_transient_bytes``). ``weight_copy_bytes``: the weight
    mode's extra copies, within ``resident_bytes``; ``pass_copy_bytes``: the copy of the
    live weights a backward holds while a stashed version is in place (modes that stash).
    """

    stage: int
    layers: tuple[int, ...]
    forward_s: float
    backward_s: float
    update_s: float
    param_bytes: int
    resident_bytes: int
    transient_bytes: int
    out_bytes: int
    in_flight: int
    layer_forward_s: tuple[float, ...]
    layer_backward_s: tuple[float, ...]
    layer_param_bytes: tuple[int, ...]
    saved: tuple[int, ...]
    kept: tuple[int, ...]
    rerun: tuple[int, ...]
    weight_copy_bytes: int = 0
    pass_copy_bytes: int = 0
    unit_extra_bytes: int = 0
    backward_transient_bytes: int | None = None
    update_transient_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved)

    @property
    def backward_working_bytes(self) -> int:
        if self.backward_transient_bytes is None:
            return self.transient_bytes
        return self.backward_transient_bytes


def stage_costs(
    profile: Profile,
    balance: Sequence[int],
    *,
    schedule: str,
    micro_batches: int,
    weights: str,
) -> tuple[StageCosts, ...]:
    """Every stage's :class:`StageCosts`; ``profile`` is one mini-batch of a replica, cut
    into ``micro_batches`` units (each 1/micro_batches of it, as the partitioner counts).

    The update takes each stage's share of the optimizer step (by parameters): the
    profile's timed step, or one pass over parameters, gradients and optimizer state at
    the GPU's memory bandwidth (:func:`workload_from_profile`).
    """
    if sum(balance) != len(profile.layers):
        raise PipeswapError(
            f"balance {list(balance)} covers {sum(balance)} layers, not the profile's "
            f"{len(profile.layers)}"
        )
    workload = workload_from_profile(profile)
    # (A stage plan recomputes by its own rule: the state a layer keeps is not weighed.)
    everything = replace(workload, held_state=()).recomputing(range(workload.num_layers))
    scale = 1.0 / micro_batches
    kind, mode = schedule_kind(schedule), weight_mode(weights)
    n = len(balance)
    total_params = profile.param_bytes or 1
    out: list[StageCosts] = []
    for k, (a, b) in enumerate(stage_bounds(balance)):
        layers = tuple(range(a, b))
        params = sum(workload.param_bytes[a:b])
        share = profile.optimizer_state_bytes * params // total_params
        in_flight = kind.in_flight_units(n, k, micro_batches)
        copies = mode.extra_weight_copies(in_flight, kind)
        out.append(
            StageCosts(
                stage=k,
                layers=layers,
                forward_s=sum(workload.forward_s[a:b]) * scale,
                backward_s=sum(workload.backward_s[a:b]) * scale,
                update_s=workload.optimizer_step_s * params / total_params,
                param_bytes=params,
                resident_bytes=(2 + copies) * params + share,
                weight_copy_bytes=copies * params,
                pass_copy_bytes=params if mode.stashes else 0,
                transient_bytes=_scaled(max(workload.transient[a:b]), scale),
                out_bytes=_scaled(profile.layers[b - 1].output_bytes, scale),
                in_flight=in_flight,
                layer_forward_s=tuple(workload.forward_s[i] * scale for i in layers),
                layer_backward_s=tuple(workload.backward_s[i] * scale for i in layers),
                layer_param_bytes=tuple(workload.param_bytes[i] for i in layers),
                saved=tuple(_scaled(workload.all_saved_bytes[i], scale) for i in layers),
                kept=tuple(_scaled(everything.saved_bytes[i], scale) for i in layers),
                rerun=tuple(_scaled(everything.recompute_bytes[i], scale) for i in layers),
            )
        )
    return tuple(out)


def _scaled(nbytes: int, scale: float) -> int:
    return int(nbytes * scale)
