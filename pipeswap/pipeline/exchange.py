"""Tied parameters' gradients between the stages that hold them, in a process group per pair."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from pipeswap.dist.p2p import Sends, pack_tag, post_receives
from pipeswap.errors import PipeswapError

__all__ = ["DistExchange"]


class DistExchange:
    """Tied parameters' gradients between holding stages, in a process group per pair.

    ``groups[(src, dst)]`` carries src's gradients to dst only, so each group's stream
    sees one direction in mini-batch order (what NCCL needs); the tag tells the mini-batch,
    group and tensor apart (what gloo needs).
    """

    # At most this many tied tensors per group of holders (the tag packs the index), and
    # this many groups of holders.
    MAX_TENSORS = 64
    MAX_GROUPS = 1024

    def __init__(
        self, stage: int, groups: dict[tuple[int, int], Any], device: torch.device, base: int = 0
    ):
        self.stage = stage
        self.base = base  # the global rank of this replica's stage 0
        self.groups = groups
        self.device = device
        self._sends: Sends[tuple[int, int, int]] = Sends()

    def _tags(self, group: int, step: int, count: int) -> list[int]:
        return [
            pack_tag(step, (group, self.MAX_GROUPS), (i, self.MAX_TENSORS)) for i in range(count)
        ]

    def send(self, group: int, step: int, dst: int, tensors: list[torch.Tensor]) -> None:
        if len(tensors) > self.MAX_TENSORS:
            raise PipeswapError(
                f"{len(tensors)} parameters are tied between the same stages, more than the "
                f"{self.MAX_TENSORS} the runtime tags: tie fewer parameters across stages"
            )
        tags = self._tags(group, step, len(tensors))
        where = self.base + dst
        self._sends.start((group, step, dst), tensors, where, tags, self.groups[(self.stage, dst)])

    def take(self, group: int, step: int, src: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        buffers = [torch.empty_like(t, device=self.device) for t in like]
        tags = self._tags(group, step, len(buffers))
        group = self.groups[(src, self.stage)]
        received = post_receives(buffers, self.base + src, tags, group).wait()
        self._sends.poll()
        return list(received)

    def finish(self, abandon: Collection[tuple[int, int, int]] = ()) -> None:
        """Wait for every send but those in ``abandon`` (saved in a checkpoint instead)."""
        self._sends.wait(abandon)
