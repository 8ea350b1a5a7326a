"""Telling a rank that lost its peers (another rank ended first) from a rank that failed."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["LOST_PEERS", "lost_peers"]

# What gloo and NCCL raise on a rank whose peer has gone: its process ended or its node died.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)

LOST_PEERS = "lost its peers: another rank ended first"


def lost_peers(exc: BaseException) -> bool:
    """True when ``exc`` is a collective or point-to-point failing because a peer is gone,
    which only echoes the failure of that peer (the report that matters is the peer's)."""
    if isinstance(exc, dist.DistNetworkError):
        return True
    if not isinstance(exc, RuntimeError):  # what gloo and NCCL raise, with their text
        return False
    text = str(exc)
    return any(pattern in text for pattern in _PEER_GONE)
