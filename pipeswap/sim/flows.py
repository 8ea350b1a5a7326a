"""Fluid transfers sharing directed links by max-min fairness (progressive filling)."""

from __future__ import annotations

import math

from pipeswap.hardware.topology import Topology

__all__ = ["Flow", "FlowNetwork", "directed_path"]

# A directed link is ``2 * link_index + direction`` (direction 0 = a->b, 1 = b->a), so
# ``dl ^ 1`` is the opposite direction and ``dl >> 1`` the undirected link.


def directed_path(topology: Topology, src: str, dst: str) -> tuple[int, ...]:
    """The directed links from ``src`` to ``dst``."""
    return tuple(2 * index + direction for index, direction in topology.path(src, dst))


class Flow:
    """One transfer in flight: ``remaining`` bytes at time ``t_ref``, moving at ``rate``."""

    __slots__ = ("links", "nbytes", "remaining", "rate", "t_ref", "end", "version", "owner")

    def __init__(self, links: tuple[int, ...], nbytes: float, owner: int) -> None:
        self.links = links
        self.nbytes = nbytes
        self.remaining = nbytes
        self.rate = 0.0
        self.t_ref = 0.0
        self.end = math.inf
        self.version = 0
        self.owner = owner


class FlowNetwork:
    """Active flows on a topology; ``settle`` recomputes rates where something changed.

    Each direction of a link has capacity ``gb_per_s * 1e9`` bytes/s, times the link's
    ``duplex_efficiency`` while the opposite direction carries at least one flow. Rates
    are the max-min fair allocation: progressive filling raises every flow's rate together
    and freezes the flows of a link when that link saturates. Only the connected
    component (flows linked through shared links) of a changed link is recomputed; the
    allocation of the others cannot change.
    """

    def __init__(self, topology: Topology, *, record_rates: bool = False) -> None:
        links = topology.links
        self.capacity = [link.bytes_per_s for link in links for _ in (0, 1)]
        self.duplex = [link.duplex_efficiency for link in links]
        directed = 2 * len(links)
        self.active_on: list[set[Flow]] = [set() for _ in range(directed)]
        self.on_link: list[set[Flow]] = [set() for _ in links]
        self.bytes = [0.0] * directed
        self.busy_s = [0.0] * directed
        self._busy_since = [0.0] * directed
        self._dirty: set[int] = set()
        self.record_rates = record_rates
        # Per directed link: (time, total bytes/s) at every change, when recording.
        self.rates: list[list[tuple[float, float]]] = [[] for _ in range(directed)]

    def start(self, flow: Flow, t: float) -> None:
        """Add ``flow`` at time ``t``; its rate is set by the next ``settle``."""
        flow.t_ref = t
        for dl in flow.links:
            active = self.active_on[dl]
            if not active:
                self._busy_since[dl] = t
            active.add(flow)
            self.on_link[dl >> 1].add(flow)
            self.bytes[dl] += flow.nbytes
            self._dirty.add(dl >> 1)

    def finish(self, flow: Flow, t: float) -> None:
        """Remove ``flow`` (done) at time ``t``."""
        flow.remaining = 0.0
        flow.version += 1
        for dl in flow.links:
            active = self.active_on[dl]
            active.discard(flow)
            if not active:
                self.busy_s[dl] += t - self._busy_since[dl]
            self.on_link[dl >> 1].discard(flow)
            self._dirty.add(dl >> 1)

    def settle(self, t: float) -> list[Flow]:
        """Recompute rates around links changed since the last call; flows whose end moved."""
        if not self._dirty:
            return []
        flows = self._component(self._dirty)
        self._dirty = set()
        rates = self._fill(flows)
        changed = []
        for flow, rate in rates.items():
            if rate != flow.rate:
                flow.remaining -= flow.rate * (t - flow.t_ref)
                flow.remaining = max(flow.remaining, 0.0)
                flow.t_ref = t
                flow.rate = rate
                flow.end = t + flow.remaining / rate if rate > 0 else math.inf
                flow.version += 1
                changed.append(flow)
        if self.record_rates:
            self._record(t, flows)
        return changed

    def _component(self, seeds: set[int]) -> list[Flow]:
        seen = set(seeds)
        stack = list(seeds)
        found: dict[Flow, None] = {}
        while stack:
            link = stack.pop()
            for flow in self.on_link[link]:
                if flow in found:
                    continue
                found[flow] = None
                for dl in flow.links:
                    if dl >> 1 not in seen:
                        seen.add(dl >> 1)
                        stack.append(dl >> 1)
        self._touched = seen
        return list(found)

    def _fill(self, flows: list[Flow]) -> dict[Flow, float]:
        unfrozen: dict[int, int] = {}
        for flow in flows:
            for dl in flow.links:
                unfrozen[dl] = unfrozen.get(dl, 0) + 1
        spare: dict[int, float] = {}
        for dl in unfrozen:
            capacity = self.capacity[dl]
            if self.active_on[dl ^ 1]:
                capacity *= self.duplex[dl >> 1]
            spare[dl] = capacity
        rates: dict[Flow, float] = {}
        while unfrozen:
            # The link with the smallest fair share saturates first; its flows freeze there.
            bottleneck, share = -1, math.inf
            for dl, count in unfrozen.items():
                fair = spare[dl] / count
                if fair < share:
                    bottleneck, share = dl, fair
            share = max(share, 0.0)
            for flow in self.active_on[bottleneck]:
                if flow in rates:
                    continue
                rates[flow] = share
                for dl in flow.links:
                    spare[dl] -= share
                    left = unfrozen[dl] - 1
                    if left:
                        unfrozen[dl] = left
                    else:
                        del unfrozen[dl]
        return rates

    def _record(self, t: float, flows: list[Flow]) -> None:
        for link in self._touched:
            for dl in (2 * link, 2 * link + 1):
                total = sum((flow.rate for flow in self.active_on[dl]), 0.0)
                series = self.rates[dl]
                if not series or series[-1][1] != total:
                    if series and series[-1][0] == t:
                        series[-1] = (t, total)
                    else:
                        series.append((t, total))
