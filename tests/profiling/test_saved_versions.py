"""pipeswap/profiling/saved_versions.py: a saved tensor changed in place is refused."""

from __future__ import annotations

import pytest
import torch

from pipeswap.profiling.saved_versions import SavedVersions


def test_a_change_seen_while_the_tensor_is_alive_is_refused_at_the_unpack() -> None:
    saved = torch.randn(3, requires_grad=True).tanh()
    versions = SavedVersions()
    versions.note(saved)
    saved.mul_(2)
    versions.settle(done=False)  # seen at a layer's edge, while the code holds it
    del saved  # gone by the unpack
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: .* version 1"):
        versions.check()


def test_what_needs_no_gradient_and_what_did_not_change_pass() -> None:
    versions = SavedVersions()
    buffer, output = torch.zeros(3), torch.randn(3, requires_grad=True).tanh()
    versions.note(buffer)  # an input or a buffer: pipeswap's re-runs put buffers back
    versions.note(output)
    buffer.add_(1)
    versions.check()
    output.mul_(2)  # after the last look (its copy on the host is what a backward reads)
    versions.check()
