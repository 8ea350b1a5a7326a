"""Tagged point-to-point transfers: tags, receives posted ahead, sends polled and waited for.

Covers: pipeswap/dist/p2p.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeswap.dist.group import pair_groups
from pipeswap.dist.launch import spawn
from pipeswap.dist.p2p import Sends, _started, pack_tag, post_receives
from pipeswap.errors import PipeswapError


def test_a_tag_packs_its_fields_most_significant_first() -> None:
    assert pack_tag(7) == 7
    assert pack_tag(5, (1, 2), (3, 16)) == (5 * 2 + 1) * 16 + 3
    assert pack_tag(2, (9, 1024), (63, 64)) == ((2 * 1024) + 9) * 64 + 63
    # Distinct fields give distinct tags.
    tags = {
        pack_tag(unit, (b, 2), (i, 4))
        for unit, b, i in itertools.product(range(5), (0, 1), range(4))
    }
    assert len(tags) == 5 * 2 * 4
    for bad in ((16, 16), (-1, 16)):
        with pytest.raises(ValueError, match="outside"):
            pack_tag(0, bad)
    with pytest.raises(ValueError, match="0 or more"):
        pack_tag(-1)


def test_a_transfer_outside_the_group_is_refused() -> None:
    with pytest.raises(PipeswapError, match="rank 3 in a process group this rank is not in"):
        _started(None, 3)


def _exchange(rank: int, world: int) -> dict[str, object]:
    """Rank 0 posts its receives first, in the reverse order of rank 1's sends; rank 1
    sends, receives the reply in a pair group, and waits for its sends at the end."""
    peer = 1 - rank
    groups = pair_groups([(0, 1), (1, 0)])
    out: dict[str, object] = {}
    if rank == 0:
        receives = [post_receives([torch.empty(3)], peer, [tag]) for tag in (12, 11, 10)]
        got = [receive.wait()[0].tolist() for receive in receives]
        out["got"] = got
        sends: Sends[str] = Sends()
        reply = torch.arange(6.0).reshape(2, 3).t()  # not contiguous: sent as a copy
        sends.start("reply", [reply, torch.ones(2)], peer, [0, 1], groups[(0, 1)])
        sends.wait()
        out["left"] = len(sends)
    else:
        sends = Sends()
        for tag in (10, 11, 12):
            sends.start(("unit", tag), [torch.full((3,), float(tag))], peer, [tag])
        started = len(sends)
        buffers = [torch.empty(3, 2), torch.empty(2)]
        reply = post_receives(buffers, peer, [0, 1], groups[(0, 1)]).wait()
        out["reply"] = [t.tolist() for t in reply]
        out["same_buffers"] = all(a is b for a, b in zip(reply, buffers, strict=True))
        sends.poll()
        out["polled"] = started >= len(sends) >= 0
        # Rank 0 has every unit (it replied after receiving them): settling one lets
        # exactly its send go, whatever gloo says of the others.
        before = len(sends)
        sends.settle(("unit", 11))
        out["settled"] = before - len(sends) in ((1,) if before == started else (0, 1))
        sends.settle(("unit", 11))  # nothing left under it: nothing to wait for
        sends.wait(abandon={("unit", 99)})
        out["left"] = len(sends)
    return out


@pytest.mark.dist
def test_tagged_transfers_match_by_tag_whatever_the_order() -> None:
    launched = spawn(_exchange, 2, timeout_s=60)
    assert launched.ok, launched.exit_codes
    first, second = launched.results
    assert first == {"got": [[12.0] * 3, [11.0] * 3, [10.0] * 3], "left": 0}
    assert second == {
        "reply": [[[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]], [1.0, 1.0]],
        "same_buffers": True,
        "polled": True,
        "settled": True,
        "left": 0,
    }
