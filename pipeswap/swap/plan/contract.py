"""The SwapPlan contract (pipeswap.swapplan/2): which saved tensors each GPU swaps or recomputes."""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format, dump_json, load_json
from pipeswap.profiling.profile import Profile
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES

__all__ = [
    "READABLE_FORMATS",
    "SWAPPLAN_FORMAT",
    "GpuPlan",
    "SwapDecision",
    "SwapPlan",
    "close_names",
    "validate_plan",
]

SWAPPLAN_FORMAT = "pipeswap.swapplan/2"
# Plans written before recomputation existed read as plans that recompute nothing.
READABLE_FORMATS = ("pipeswap.swapplan/1", SWAPPLAN_FORMAT)


@dataclass(frozen=True)
class SwapDecision:
    """The plan's swap decision about one saved tensor, by layer name (its JSON form): the
    tensor goes to host memory and comes back.

    ``layer``/``index`` name the tensor as the profiler does (layer name, saved index).
    The swap-out is issued right after the forward of layer ``out_after`` (the owner or a
    later layer). The prefetch is issued right after the backward of layer
    ``prefetch_after`` (a later layer than the owner), or at the forward/backward turn
    (right after the last forward) when ``prefetch_after`` is None.
    """

    layer: str
    index: int
    bytes: int
    out_after: str
    prefetch_after: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "index": self.index,
            "bytes": self.bytes,
            "out_after": self.out_after,
            "prefetch_after": self.prefetch_after,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SwapDecision:
        prefetch = obj.get("prefetch_after")
        return cls(
            layer=str(obj["layer"]),
            index=int(obj["index"]),
            bytes=int(obj["bytes"]),
            out_after=str(obj.get("out_after", obj["layer"])),
            prefetch_after=None if prefetch is None else str(prefetch),
        )


@dataclass(frozen=True)
class GpuPlan:
    """The plan of one data-parallel rank: its swaps, recomputed layers, offset and budget.

    ``recompute`` names the layers whose saved tensors are neither kept nor swapped: only
    the layer's input is kept, and the layer's forward is run again in the backward pass,
    right before the layer's backward (recomputation of that block). Those also named in
    ``selective`` are recomputed selectively: they keep the outputs dear to compute too,
    and re-run the rest (pipeswap.swap.runtime.selective).
    """

    gpu: str
    rank: int
    budget_bytes: int
    offset_s: float
    swaps: tuple[SwapDecision, ...] = ()
    recompute: tuple[str, ...] = ()
    selective: tuple[str, ...] = ()

    @property
    def swapped_bytes(self) -> int:
        return sum(s.bytes for s in self.swaps)

    def check_recompute(self, layers: Sequence[str], owner: str) -> None:
        """Refuse a recompute list naming a layer ``owner`` lacks, or one layer twice."""
        for name in self.recompute:
            if name not in layers:
                raise PipeswapError(
                    f"{self.gpu}: the plan recomputes layer {name!r}, which {owner} does not "
                    f"have; {close_names(name, layers)}"
                )
        if len(set(self.recompute)) != len(self.recompute):
            raise PipeswapError(f"{self.gpu}: a layer is listed twice under recompute")
        for name in self.selective:
            if name not in self.recompute:
                raise PipeswapError(
                    f"{self.gpu}: layer {name!r} is listed under selective but not under "
                    "recompute; a layer recomputed selectively is listed under both"
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "rank": self.rank,
            "budget_bytes": self.budget_bytes,
            "offset_s": self.offset_s,
            "swapped_bytes": self.swapped_bytes,
            "swaps": [s.to_json() for s in self.swaps],
            "recompute": list(self.recompute),
            **({"selective": list(self.selective)} if self.selective else {}),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> GpuPlan:
        return cls(
            gpu=str(obj["gpu"]),
            rank=int(obj["rank"]),
            budget_bytes=int(obj["budget_bytes"]),
            offset_s=float(obj.get("offset_s", 0.0)),
            swaps=tuple(SwapDecision.from_json(s) for s in obj.get("swaps", [])),
            recompute=tuple(str(n) for n in obj.get("recompute", [])),
            selective=tuple(str(n) for n in obj.get("selective", [])),
        )


@dataclass(frozen=True)
class SwapPlan:
    """Per-GPU swap decisions for one training iteration of a data-parallel job.

    ``predicted_iteration_s`` is the simulated iteration time of the plan,
    ``lower_bound_s`` the bound of design.md and ``turn_bound_s`` the turn bound
    (pipeswap.swap.plan.bounds); ``notes`` holds policy-specific numbers (e.g. the MIP's own
    estimate and gap). ``batch``, ``dtype``, ``seq_len`` and ``image_size`` record the
    profile the plan was made for, so a runtime can refuse it for another profile even
    when it swaps nothing; plans written before these fields existed load with None.
    """

    policy: str
    model: str
    layers: tuple[str, ...]
    gpus: tuple[GpuPlan, ...]
    sync_every: int = 1
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    predicted_iteration_s: float = 0.0
    lower_bound_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    batch: int | None = None
    dtype: str | None = None
    seq_len: int | None = None
    image_size: int | None = None
    turn_bound_s: float = 0.0

    def profile_mismatch(self, profile: Profile) -> str | None:
        """What differs between the profile this plan was made for and ``profile``, as
        ``"batch 8 (plan) vs 4 (profile)"``; None when nothing recorded differs."""
        differences = [
            f"{name} {mine} (plan) vs {theirs} (profile)"
            for name, mine, theirs in (
                ("model", self.model, profile.model),
                ("batch", self.batch, profile.batch),
                ("dtype", self.dtype, profile.dtype),
                ("seq_len", self.seq_len, profile.seq_len),
                ("image_size", self.image_size, profile.image_size),
            )
            if mine is not None and mine != theirs
        ]
        return ", ".join(differences) or None

    def gpu_plan(self, gpu: str) -> GpuPlan:
        for plan in self.gpus:
            if plan.gpu == gpu:
                return plan
        known = ", ".join(p.gpu for p in self.gpus)
        raise PipeswapError(f"the plan has no GPU {gpu!r}; it plans for {known}")

    def validate(self, profile: Profile) -> None:
        """Refuse a plan that does not fit ``profile``: unknown tensors, points out of order."""
        validate_plan(self, profile)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SWAPPLAN_FORMAT,
            "policy": self.policy,
            "model": self.model,
            "layers": list(self.layers),
            "sync_every": self.sync_every,
            "bucket_bytes": self.bucket_bytes,
            "predicted_iteration_s": self.predicted_iteration_s,
            "lower_bound_s": self.lower_bound_s,
            "turn_bound_s": self.turn_bound_s,
            "batch": self.batch,
            "dtype": self.dtype,
            "seq_len": self.seq_len,
            "image_size": self.image_size,
            "notes": self.notes,
            "gpus": [g.to_json() for g in self.gpus],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "swap plan") -> SwapPlan:
        if obj.get("format") not in READABLE_FORMATS:
            check_format(obj, SWAPPLAN_FORMAT, where)
        try:
            return cls(
                policy=str(obj["policy"]),
                model=str(obj["model"]),
                layers=tuple(str(n) for n in obj["layers"]),
                gpus=tuple(GpuPlan.from_json(g) for g in obj["gpus"]),
                sync_every=int(obj.get("sync_every", 1)),
                bucket_bytes=int(obj.get("bucket_bytes", DEFAULT_BUCKET_BYTES)),
                predicted_iteration_s=float(obj.get("predicted_iteration_s", 0.0)),
                lower_bound_s=float(obj.get("lower_bound_s", 0.0)),
                notes=dict(obj.get("notes", {})),
                batch=_optional_int(obj.get("batch")),
                dtype=None if obj.get("dtype") is None else str(obj["dtype"]),
                seq_len=_optional_int(obj.get("seq_len")),
                image_size=_optional_int(obj.get("image_size")),
                turn_bound_s=float(obj.get("turn_bound_s", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PipeswapError(f"{where}: malformed swap plan ({exc!r})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SwapPlan:
        return cls.from_json(load_json(path), where=str(path))


def close_names(name: str, candidates: Sequence[str]) -> str:
    """``did you mean ...?`` for a misspelt layer name, else the layers there are."""
    close = difflib.get_close_matches(name, list(candidates), n=4, cutoff=0.5)
    if close:
        return "did you mean " + ", ".join(repr(c) for c in close) + "?"
    return "the layers are " + ", ".join(candidates[:12]) + (" ..." if len(candidates) > 12 else "")


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def validate_plan(plan: SwapPlan, profile: Profile) -> None:
    names = profile.layer_names
    mismatch = plan.profile_mismatch(profile)
    if mismatch is not None:
        raise PipeswapError(
            f"the plan was made for another profile ({mismatch}); make the plan from this profile"
        )
    if list(plan.layers) != names:
        raise PipeswapError(
            f"the plan was made for layers {list(plan.layers)[:4]}... of {plan.model}, "
            f"not for this profile of {profile.model}; make the plan from this profile"
        )
    position = {name: i for i, name in enumerate(names)}
    sizes = {(layer.name, t.index): t.bytes for layer in profile.layers for t in layer.saved}
    if plan.sync_every < 1:
        raise PipeswapError(f"sync_every is {plan.sync_every}; use 1 or more")
    for gpu in plan.gpus:
        gpu.check_recompute(names, "the profile")
        recomputed = set(gpu.recompute)
        seen: set[tuple[str, int]] = set()
        for swap in gpu.swaps:
            key = (swap.layer, swap.index)
            where = f"{gpu.gpu}: tensor ({swap.layer!r}, {swap.index})"
            if key not in sizes:
                saved = (
                    [t.index for t in profile.layer(swap.layer).saved]
                    if (swap.layer in position)
                    else None
                )
                hint = (
                    f"layer {swap.layer!r} saves indices {saved}"
                    if saved is not None
                    else f"layers are {', '.join(names)}"
                )
                raise PipeswapError(f"{where} is not in the profile; {hint}")
            if key in seen:
                raise PipeswapError(f"{where} is swapped twice; list each tensor once")
            if swap.layer in recomputed:
                raise PipeswapError(
                    f"{where} is swapped, but its layer is recomputed; a recomputed layer "
                    "keeps no saved tensor, so drop the swap or the recompute"
                )
            seen.add(key)
            if swap.bytes != sizes[key]:
                raise PipeswapError(
                    f"{where} has {swap.bytes} bytes in the plan but {sizes[key]} in the "
                    "profile; make the plan from this profile"
                )
            owner = position[swap.layer]
            if position.get(swap.out_after, -1) < owner:
                raise PipeswapError(
                    f"{where}: swap-out after {swap.out_after!r}, which is not the owner "
                    "or a later layer"
                )
            if swap.prefetch_after is not None and position.get(swap.prefetch_after, -1) <= owner:
                raise PipeswapError(
                    f"{where}: prefetch after the backward of {swap.prefetch_after!r}, which "
                    "is not a later layer than the owner; name a later layer or null (the turn)"
                )
