"""A machine as measured (pipeswap topology calibrate): its numbers, and a topology of them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeswap.errors import PipeswapError, first_line
from pipeswap.hardware.topology import GB, Link, Node, Topology

__all__ = [
    "CALIBRATION_FORMAT",
    "Calibration",
    "calibrated_path",
    "fit_latency_bandwidth",
    "found_calibration",
    "host_memory_bytes",
]

CALIBRATION_FORMAT = "pipeswap.calibration/1"


def fit_latency_bandwidth(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bytes/s) of ``seconds = latency + bytes / bandwidth``, least squares over
    ``(bytes, seconds)`` points; the latency is kept at 0 or more, and where the larger
    sizes were not slower (noise) the fastest rate seen stands alone."""
    if len(points) < 2:
        raise PipeswapError("a latency and a bandwidth need measurements at 2 sizes or more")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    latency = mean_y - slope * mean_x
    if latency < 0:  # through the origin instead
        latency = 0.0
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    if slope <= 0:  # noise swamped the sizes: the best rate seen, no latency
        return 0.0, max(x / y for x, y in points)
    return latency, 1.0 / slope


@dataclass(frozen=True)
class Calibration:
    """What ``pipeswap topology calibrate`` measured on one machine (see pipeswap.dist.calibrate).

    ``copy_bytes_per_s[kind] = (alone, together)``: one rank's copy rate with the others
    idle, and each rank's when all copy at once (kinds ``h2d-pinned``, ``d2h-pageable``,
    ``both-pinned``, ...). ``allreduce`` and ``p2p``: (latency s, bytes/s) fits of the
    backend's collectives, the all-reduce's bandwidth as bus bandwidth (bytes x 2(n-1)/n
    per second, nccl-tests' busbw). ``compute_slowdown``: a rank's compute time with every
    rank computing over its time alone. ``transfer_slowdown``: a one-thread rank's compute
    time while it exchanges messages with another over its time without (None with one
    rank); what a pipeline stage's compute pays for its transfers. ``stage_slowdown``: a
    one-thread rank's compute time with every rank computing over its time alone (more
    ranks than cores share them; None in files written before it was measured).
    """

    ranks: int
    device: str
    backend: str
    copy_bytes_per_s: dict[str, tuple[float, float]]
    allreduce: tuple[float, float] | None  # None with one rank: nothing to reduce
    p2p: tuple[float, float] | None
    compute_slowdown: float
    date: str
    command: str
    transfer_slowdown: float | None = None
    stage_slowdown: float | None = None

    @classmethod
    def from_ranks(
        cls, measured: Sequence[dict[str, Any]], *, date: str, command: str
    ) -> Calibration:
        """One calibration from every rank's :func:`pipeswap.dist.calibrate.measure_rank`."""
        first, n = measured[0], len(measured)
        copies = {
            kind: (
                float(first["copy"][kind]["alone"]),
                min(float(r["copy"][kind]["together"]) for r in measured),
            )
            for kind in first["copy"]
        }
        bus = 2 * (n - 1) / n if n > 1 else 1.0
        slowest = [
            (size * bus, max(float(r["allreduce"][i][1]) for r in measured))
            for i, (size, _) in enumerate(first["allreduce"])
        ]
        received = [r for r in measured if r["rank"] % 2 == 1]
        p2p = None
        if received:
            p2p = fit_latency_bandwidth(
                [
                    (size, max(float(r["p2p"][i][1]) for r in received))
                    for i, (size, _) in enumerate(first["p2p"])
                ]
            )
        alone = float(first["compute"]["alone"])
        together = max(float(r["compute"]["together"]) for r in measured)
        slowed = [
            float(r["compute"]["with_p2p"])
            for r in measured
            if r["compute"].get("with_p2p") is not None
        ]
        return cls(
            ranks=n,
            device=first["device"],
            backend=first["backend"],
            copy_bytes_per_s=copies,
            allreduce=fit_latency_bandwidth(slowest) if n > 1 else None,
            p2p=p2p,
            compute_slowdown=max(1.0, together / alone),
            date=date,
            command=command,
            transfer_slowdown=max(slowed) if slowed else None,
            stage_slowdown=_stage_slowdown(measured),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CALIBRATION_FORMAT,
            "measured": True,
            "date": self.date,
            "command": self.command,
            "ranks": self.ranks,
            "device": self.device,
            "backend": self.backend,
            "copy_gb_per_s": {
                kind: {"alone": alone / GB, "every_rank": together / GB}
                for kind, (alone, together) in self.copy_bytes_per_s.items()
            },
            "allreduce": None
            if self.allreduce is None
            else {"latency_s": self.allreduce[0], "bus_gb_per_s": self.allreduce[1] / GB},
            "p2p": None
            if self.p2p is None
            else {"latency_s": self.p2p[0], "gb_per_s": self.p2p[1] / GB},
            "compute_slowdown": self.compute_slowdown,
            "transfer_slowdown": self.transfer_slowdown,
            "stage_slowdown": self.stage_slowdown,
        }

    def topology(self, name: str, memory_bytes: int) -> Topology:
        """The machine as a topology: a node per rank under one host, each link's bandwidth
        the measured host-to-device copy rate with every rank copying (pinned where there
        is a GPU), both directions at once scaling it as measured."""
        kind = "h2d-pinned" if "h2d-pinned" in self.copy_bytes_per_s else "h2d-pageable"
        one_way = self.copy_bytes_per_s[kind][1]
        both_kind = kind.replace("h2d", "both")
        duplex = 1.0
        if both_kind in self.copy_bytes_per_s:
            # Both directions together move their sum; per direction, the share of one alone.
            duplex = min(1.0, self.copy_bytes_per_s[both_kind][1] / 2 / one_way)
        gpus = [
            Node(f"gpu{i}", "gpu", memory_bytes=memory_bytes, spec=self.device)
            for i in range(self.ranks)
        ]
        links = tuple(Link(g.id, "cpu0", one_way / GB, duplex_efficiency=duplex) for g in gpus)
        return Topology(name, (Node("cpu0", "cpu"), *gpus), links, calibration=self.to_json())


def _stage_slowdown(measured: Sequence[dict[str, Any]]) -> float | None:
    """One thread's compute with every rank at once over rank 0's alone (None: unmeasured)."""
    one = [r["compute"].get("one_thread") for r in measured]
    if any(o is None for o in one) or one[0]["alone"] is None:
        return None
    together = max(float(o["together"]) for o in one)
    return max(1.0, together / float(one[0]["alone"]))


def host_memory_bytes() -> int:
    """This machine's physical memory (what CPU ranks share as their "device" memory)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrated_path(device: str, nproc: int) -> Path:
    """Where ``pipeswap topology calibrate`` keeps this machine's calibration for ``nproc``
    ranks on ``device`` when no --out is given: ``$PIPESWAP_HOME`` (default
    ``~/.cache/pipeswap``)/calibrated-DEVICE-N.json."""
    home = os.environ.get("PIPESWAP_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "pipeswap"
    )
    return Path(home) / f"calibrated-{device}-{nproc}.json"


def found_calibration(device: str, nproc: int) -> Topology | None:
    """This machine's calibrated topology for ``nproc`` ranks on ``device``, if one was made."""
    path = calibrated_path(device, nproc)
    if not path.is_file():
        return None
    try:
        return Topology.load(path)
    except PipeswapError as exc:  # every later run would stop here: name the way out
        raise PipeswapError(
            f"the calibration kept for {nproc} {device} rank(s) at {path} cannot be read "
            f"({first_line(exc)}): make it again (pipeswap topology calibrate, for this "
            "device and number of ranks), or delete the file to plan on a preset"
        ) from None
