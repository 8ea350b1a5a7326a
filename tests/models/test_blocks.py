"""pipeswap/models/blocks.py: the block finder, block paths, and the modules around the blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import check_block_paths, find_blocks, modules_around
from tests.models.tiny_lm import TinyLM


def test_find_blocks_takes_the_largest_repeated_list() -> None:
    net = TinyLM()
    assert find_blocks(net) == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(PipeswapError, match="no list of 2 or more layers"):
        find_blocks(nn.Linear(2, 2))


def test_block_paths_must_name_disjoint_modules() -> None:
    net = TinyLM()
    check_block_paths(net, ["blocks.0", "blocks.1", "blocks.2"])
    with pytest.raises(PipeswapError, match="name at least one block"):
        check_block_paths(net, [])
    with pytest.raises(PipeswapError, match="has no module 'blocks.7'"):
        check_block_paths(net, ["blocks.0", "blocks.7"])
    with pytest.raises(PipeswapError, match="blocks 'blocks' and 'blocks.1' overlap"):
        check_block_paths(net, ["blocks", "blocks.1"])


def test_modules_before_and_after_the_blocks_are_found() -> None:
    net = TinyLM()
    blocks = [net.get_submodule(f"blocks.{i}") for i in range(3)]
    ids = torch.zeros(1, 4, dtype=torch.long)
    before, after = modules_around(net, blocks, lambda: net(ids))
    assert list(before) == ["embed"] and list(after) == ["norm", "out"]
    skipped = [blocks[0], blocks[2]]
    with pytest.raises(PipeswapError, match="runs blocks.1.mix between its blocks"):
        modules_around(net, skipped, lambda: net(ids))
