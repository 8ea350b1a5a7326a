"""pipeswap/models/blocks.py: the block finder, block paths, and the modules around the blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.blocks import candidate_layers, check_block_paths, find_blocks, modules_around
from tests.models.tiny_lm import TinyLM


def test_find_blocks_takes_the_largest_repeated_list() -> None:
    net = TinyLM()
    assert find_blocks(net) == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(PipeswapError, match="no list of 2 or more layers"):
        find_blocks(nn.Linear(2, 2))


def test_find_blocks_skips_a_list_of_lists() -> None:
    """Funnel's encoder keeps its layers in a ModuleList of ModuleLists: the outer list has
    the most parameters, but a forward calls the inner lists' layers, never the lists."""
    net = nn.Module()
    net.blocks = nn.ModuleList(nn.ModuleList(nn.Linear(4, 4) for _ in range(2)) for _ in range(3))
    net.head = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])
    assert find_blocks(net) == ["blocks.0.0", "blocks.0.1"]
    with pytest.raises(PipeswapError, match="no list of 2 or more layers"):
        find_blocks(nn.ModuleList(nn.ModuleList([nn.Linear(2, 2)]) for _ in range(2)))


def test_find_blocks_takes_a_hybrid_s_list_where_no_list_has_one_class() -> None:
    """OLMo hybrid alternates linear and full attention layers of two classes in one
    ModuleList; a Sequential of several classes is a chain of operations, never taken."""
    net = nn.Module()
    net.layers = nn.ModuleList([nn.Linear(4, 4), nn.Conv1d(4, 4, 1), nn.Linear(4, 4)])
    net.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))  # more parameters
    assert find_blocks(net) == ["layers.0", "layers.1", "layers.2"]
    net.tower = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # one class: preferred
    assert find_blocks(net) == ["tower.0", "tower.1"]
    with pytest.raises(PipeswapError, match="no list of 2 or more layers"):
        find_blocks(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)))


def test_a_list_holding_one_module_several_times_is_no_cut_and_says_why() -> None:
    """ALBERT-style sharing: ``ModuleList([block] * 4)`` has one child module, which
    ``named_children`` yields once; cut there it was one layer, and every budget failed
    with no reason given."""
    shared = nn.Linear(8, 8)
    model = nn.Module()
    model.layers = nn.ModuleList([shared] * 4)
    with pytest.raises(PipeswapError, match=r"'layers' holds one module more than once"):
        find_blocks(model)
    model.other = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))  # a list that can be cut
    assert find_blocks(model) == ["other.0", "other.1"]


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


def test_an_encoder_decoder_model_swaps_around_both_stacks_in_forward_order() -> None:
    transformers = pytest.importorskip("transformers")
    from pipeswap.models.blocks import every_stack

    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2
    )
    t5 = transformers.T5ForConditionalGeneration(config)
    assert find_blocks(t5) == ["decoder.block.0", "decoder.block.1", "decoder.block.2"]
    assert every_stack(t5) == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
        "decoder.block.2",
    ]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2))
    assert every_stack(gpt2) == find_blocks(gpt2) == ["transformer.h.0", "transformer.h.1"]


def test_a_model_without_a_layer_list_is_hinted_at_its_own_modules() -> None:
    """ALBERT (one shared layer group) was told to name layers=['encoder.0', ...], a module
    it does not have: the hint names the model's own, its largest opened up."""
    net = nn.Module()
    net.embed = nn.Linear(2, 4)
    net.body = nn.Module()
    net.body.mix, net.body.out = nn.Linear(4, 16), nn.Linear(16, 4)
    net.head = nn.Linear(4, 2)
    assert candidate_layers(net) == ["embed", "body.mix", "body.out", "head"]
    assert candidate_layers(net, most=3) == ["embed", "body", "head"]
    with pytest.raises(PipeswapError, match=r"blocks=\['embed', 'body.mix', 'body.out', 'head'\]"):
        find_blocks(net)
