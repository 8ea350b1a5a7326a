"""The Layout contract (pipeswap.layout/1): how a job is laid out on a server, and what it gives."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format, dump_json, load_json

__all__ = [
    "DATA_PARALLEL",
    "FAMILIES",
    "FAMILY_TITLES",
    "LAYOUT_FORMAT",
    "PIPELINE",
    "PIPELINE_DP",
    "PIPELINE_SWAP",
    "Layout",
    "StageLayout",
]

LAYOUT_FORMAT = "pipeswap.layout/1"

DATA_PARALLEL = "data-parallel"
PIPELINE = "pipeline"
PIPELINE_SWAP = "pipeline-swap"
PIPELINE_DP = "pipeline-dp"
# The families the planner searches, in the order it reports them.
FAMILIES = (DATA_PARALLEL, PIPELINE, PIPELINE_SWAP, PIPELINE_DP)
FAMILY_TITLES = {
    DATA_PARALLEL: "data parallel + swap/recompute",
    PIPELINE: "pipeline",
    PIPELINE_SWAP: "pipeline, stages swap",
    PIPELINE_DP: "pipeline x data parallel",
}


@dataclass(frozen=True)
class StageLayout:
    """One stage: its layers by name, which of them swap or are recomputed, and its
    simulated peak memory (the largest over its replicas)."""

    stage: int
    layers: tuple[str, ...]
    swapped: tuple[str, ...] = ()
    recomputed: tuple[str, ...] = ()
    prefetch_lead: int = 0
    peak_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": list(self.layers),
            "swapped": list(self.swapped),
            "recomputed": list(self.recomputed),
            "prefetch_lead": self.prefetch_lead,
            "peak_bytes": self.peak_bytes,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StageLayout:
        return cls(
            int(obj["stage"]),
            tuple(str(x) for x in obj["layers"]),
            tuple(str(x) for x in obj.get("swapped", ())),
            tuple(str(x) for x in obj.get("recomputed", ())),
            int(obj.get("prefetch_lead", 0)),
            int(obj.get("peak_bytes", 0)),
        )


@dataclass(frozen=True)
class Layout:
    """One layout of ``model`` on ``topology`` within ``budget_bytes`` per GPU, as simulated.

    ``stages`` x ``replicas`` GPUs (data parallel: 1 stage). ``batch`` is the profile's
    batch, the samples one data-parallel GPU takes per step; every layout of one search
    moves ``samples_per_step`` samples per step and ``samples_per_update`` per
    optimizer update of a stage. ``samples_per_s`` is the steady-state rate and
    ``peak_bytes`` the largest GPU's peak; ``graph_s`` is the makespan of the exported
    graph (``steps`` steps, fill and drain included): simulating that graph on the
    topology with ``budget_bytes`` per GPU gives it again. ``placement``: per replica,
    the GPU of each stage; ``mapping`` names the rule that chose it; ``coordinated``:
    stages that share a PCIe switch planned their copies together (pipeline families).
    """

    family: str
    model: str
    topology: str
    budget_bytes: int
    batch: int
    stages: int
    replicas: int
    samples_per_step: int
    samples_per_update: int
    samples_per_s: float
    peak_bytes: int
    graph_s: float
    steps: int
    schedule: str | None = None
    weights: str | None = None
    micro_batches: int = 1
    balance: tuple[int, ...] = ()
    placement: tuple[tuple[str, ...], ...] = ()
    mapping: str = ""
    coordinated: bool = False
    swap_policy: str | None = None
    stage_plans: tuple[StageLayout, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def gpus(self) -> int:
        return self.stages * self.replicas

    @property
    def swaps(self) -> bool:
        """Some stage swaps or recomputes (a pipeline family's stage plans)."""
        return any(p.swapped or p.recomputed for p in self.stage_plans)

    @property
    def name(self) -> str:
        """A short description: ``dp8 hybrid``, ``pp4x2 1f1b m8 (cross, coordinated)``."""
        if self.family == DATA_PARALLEL:
            return f"dp{self.replicas} {self.swap_policy}"
        shape = f"pp{self.stages}" + (f"x{self.replicas}" if self.replicas > 1 else "")
        micro = f" m{self.micro_batches}" if self.micro_batches > 1 else ""
        how = ", coordinated" if self.coordinated else ", uncoordinated"
        how = how if self.swaps else ""
        return f"{shape} {self.schedule}{micro} ({self.mapping}{how})"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": LAYOUT_FORMAT,
            "family": self.family,
            "model": self.model,
            "topology": self.topology,
            "budget_bytes": self.budget_bytes,
            "batch": self.batch,
            "stages": self.stages,
            "replicas": self.replicas,
            "samples_per_step": self.samples_per_step,
            "samples_per_update": self.samples_per_update,
            "samples_per_s": self.samples_per_s,
            "peak_bytes": self.peak_bytes,
            "graph_s": self.graph_s,
            "steps": self.steps,
            "schedule": self.schedule,
            "weights": self.weights,
            "micro_batches": self.micro_batches,
            "balance": list(self.balance),
            "placement": [list(row) for row in self.placement],
            "mapping": self.mapping,
            "coordinated": self.coordinated,
            "swap_policy": self.swap_policy,
            "stage_plans": [p.to_json() for p in self.stage_plans],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str = "layout") -> Layout:
        check_format(obj, LAYOUT_FORMAT, where)
        try:
            return cls(
                family=str(obj["family"]),
                model=str(obj["model"]),
                topology=str(obj["topology"]),
                budget_bytes=int(obj["budget_bytes"]),
                batch=int(obj["batch"]),
                stages=int(obj["stages"]),
                replicas=int(obj["replicas"]),
                samples_per_step=int(obj["samples_per_step"]),
                samples_per_update=int(obj["samples_per_update"]),
                samples_per_s=float(obj["samples_per_s"]),
                peak_bytes=int(obj["peak_bytes"]),
                graph_s=float(obj["graph_s"]),
                steps=int(obj["steps"]),
                schedule=obj.get("schedule"),
                weights=obj.get("weights"),
                micro_batches=int(obj.get("micro_batches", 1)),
                balance=tuple(int(b) for b in obj.get("balance", ())),
                placement=tuple(tuple(str(g) for g in row) for row in obj.get("placement", ())),
                mapping=str(obj.get("mapping", "")),
                coordinated=bool(obj.get("coordinated", False)),
                swap_policy=obj.get("swap_policy"),
                stage_plans=tuple(StageLayout.from_json(p) for p in obj.get("stage_plans", ())),
                notes=tuple(str(n) for n in obj.get("notes", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PipeswapError(f"{where}: malformed layout ({exc!r})") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        dump_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Layout:
        return cls.from_json(load_json(path, LAYOUT_FORMAT), str(path))
