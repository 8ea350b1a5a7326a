"""A rank that lost its peers is told from a rank that failed.

Covers: pipeswap/dist/peers.py.
"""

from __future__ import annotations

import torch.distributed as dist

from pipeswap.dist.peers import lost_peers

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:63690. This is typically caused by a remote worker crashing."
)


def test_what_gloo_and_nccl_raise_when_a_peer_is_gone() -> None:
    assert lost_peers(RuntimeError(GLOO))
    assert lost_peers(RuntimeError("[pair.cc:598] Connection reset by peer"))
    assert lost_peers(dist.DistNetworkError("the store is gone"))
    assert lost_peers(RuntimeError("NCCL communicator was aborted on rank 1"))


def test_other_failures_are_the_rank_s_own() -> None:
    assert not lost_peers(RuntimeError("CUDA out of memory"))
    assert not lost_peers(ValueError("Connection closed by peer"))  # not a transport error
    assert not lost_peers(KeyboardInterrupt())
    assert not lost_peers(BrokenPipeError(32, "Broken pipe"))  # our stdout's reader left
