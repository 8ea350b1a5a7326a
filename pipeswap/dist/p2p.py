"""Tagged point-to-point transfers: receives posted into given buffers, sends started and polled.

The pipeline's runtime decides which tensors go where under which tag, and when; this
module is the one place those transfers touch ``torch.distributed``. Both ends name a
message by the same tag (:func:`pack_tag` packs several small fields into one), so
messages between two ranks may be posted in any order under gloo. NCCL ignores tags and
matches transfers by their order on a pair's stream: there the caller posts in the order
the peer does, or gives each direction a process group of its own.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from pipeswap.errors import PipeswapError

__all__ = ["Receive", "Sends", "pack_tag", "post_receives"]

Key = TypeVar("Key", bound=Hashable)


def pack_tag(first: int, *fields: tuple[int, int]) -> int:
    """One message tag from integer fields, most significant first (mixed radix).

    ``first`` is unbounded; each further field is ``(value, limit)`` with ``0 <= value <
    limit``: ``pack_tag(unit, (1, 2), (index, 16)) == (unit * 2 + 1) * 16 + index``.
    """
    if first < 0:
        raise ValueError(f"a tag's leading field must be 0 or more, not {first}")
    tag = first
    for value, limit in fields:
        if not 0 <= value < limit:
            raise ValueError(f"tag field {value} is outside [0, {limit})")
        tag = tag * limit + value
    return tag


def _started(work: Any, peer: int) -> Any:
    """The handle of a transfer this rank started (torch returns None outside the group)."""
    if work is None:
        raise PipeswapError(f"a transfer with rank {peer} in a process group this rank is not in")
    return work


class Receive:
    """Receives posted into ``buffers`` (one tag each) from ``src``; :meth:`wait` fills them.

    Posting ahead lets a message arrive while this rank computes; the buffers must not
    be read before :meth:`wait` returns.
    """

    def __init__(
        self, buffers: Sequence[torch.Tensor], src: int, tags: Sequence[int], group: Any = None
    ) -> None:
        self.buffers = tuple(buffers)
        self._works = [
            _started(dist.irecv(buffer, src=src, tag=tag, group=group), src)
            for buffer, tag in zip(self.buffers, tags, strict=True)
        ]

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The buffers, once every receive has completed."""
        for work in self._works:
            work.wait()
        return self.buffers


def post_receives(
    buffers: Sequence[torch.Tensor], src: int, tags: Sequence[int], group: Any = None
) -> Receive:
    """Post a receive from ``src`` into each buffer, under its tag (``group``: None, the job's)."""
    return Receive(buffers, src, tags, group)


class Sends(Generic[Key]):
    """Sends in flight, each filed under a key of the caller's (e.g. a unit and direction).

    A send is never waited for until :meth:`wait` (only polled), so a rank is never
    blocked by a transfer its peer has not asked for yet. Each payload is kept alive
    until its send completes.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Any, torch.Tensor, Key]] = []

    def start(
        self,
        key: Key,
        tensors: Sequence[torch.Tensor],
        dst: int,
        tags: Sequence[int],
        group: Any = None,
    ) -> None:
        """Start sending each tensor (a contiguous copy when needed) to ``dst`` under its tag."""
        for tensor, tag in zip(tensors, tags, strict=True):
            payload = tensor.detach().contiguous()
            work = dist.isend(payload, dst=dst, tag=tag, group=group)
            self._pending.append((_started(work, dst), payload, key))

    def poll(self) -> None:
        """Let go of the sends that have completed."""
        self._pending = [s for s in self._pending if not s[0].is_completed()]

    def settle(self, key: Key) -> None:
        """Wait for the sends under ``key`` (known received: gloo says so only when
        asked) and let their payloads go."""
        for work, _, filed in self._pending:
            if filed == key:
                work.wait()
        self._pending = [s for s in self._pending if s[2] != key]

    def wait(self, abandon: Collection[Key] = ()) -> None:
        """Wait for every send but those filed under a key in ``abandon``; forget them all."""
        for work, _, key in self._pending:
            if key not in abandon:
                work.wait()
        self._pending = []

    def __len__(self) -> int:
        """Sends started and not yet let go."""
        return len(self._pending)
