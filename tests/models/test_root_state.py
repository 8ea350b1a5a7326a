"""pipeswap/models/root_state.py: the tensors a model holds itself go to the layers that use them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.adapt import adapt
from pipeswap.models.base import evaluating


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(x))


class _RootHeld(nn.Module):
    """A position table read before the blocks, a scale after them, a table read on both
    sides, one never read, a frozen bias and a buffer, all held by the root itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.pos = nn.Parameter(torch.randn(16, 8) * 0.1)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.scale = nn.Parameter(torch.ones(8))
        self.both = nn.Parameter(torch.randn(8) * 0.1)
        self.unused = nn.Parameter(torch.zeros(2))
        self.frozen = nn.Parameter(torch.randn(8) * 0.1, requires_grad=False)
        self.register_buffer("shift", torch.full((8,), 0.5))
        self.out = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.embed(ids)
        h = e + self.pos[: ids.shape[1]] + self.both + self.shift
        for block in self.blocks:
            h = block(h)
        # After the blocks: the embedding's output again (a skip) and its weight (tied).
        return self.out(h * self.scale + self.both + self.frozen + e) + h @ self.embed.weight.T


def test_each_root_parameter_goes_to_the_layers_whose_output_depends_on_it() -> None:
    torch.manual_seed(0)
    model = _RootHeld()
    layered = adapt(model, example=torch.randint(0, 32, (1, 6)))
    embed, head = layered.get_submodule("embed"), layered.get_submodule("head")
    assert set(embed._parameters) == {"pos", "both", "unused"}
    assert set(head._parameters) == {"scale", "both", "frozen", "embed__weight"}
    assert head._parameters["embed__weight"] is model.embed.weight
    assert embed._parameters["pos"] is model.pos and head._parameters["both"] is model.both
    assert not model.frozen.requires_grad
    assert set(embed._buffers) == set(head._buffers) == {"shift"}


def test_the_root_parameters_train_as_in_the_plain_loop() -> None:
    torch.manual_seed(0)
    model, plain = _RootHeld(), _RootHeld()
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 32, (4, 6))
    layered = adapt(model, example=ids[:1])
    for net in (layered, plain):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        net(ids).square().mean().backward()
        optimizer.step()
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=1e-6, atol=1e-6)
    assert not torch.equal(plain.pos, _RootHeld().pos)


def test_a_moved_layer_moves_the_root_s_buffer_the_forward_reads() -> None:
    model = _RootHeld()
    layered = adapt(model, example=torch.randint(0, 32, (1, 6)))
    layered.to(torch.float64)
    assert model.shift.dtype == torch.float64 and model.pos.dtype == torch.float64
    ids = torch.randint(0, 32, (2, 6))
    assert layered(ids).dtype == torch.float64


class _Dropped(nn.Module):
    """Dropout in the model's own code before its blocks, and in its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.drop = nn.Dropout(0.5)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(2)
        )
        self.out = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@pytest.mark.parametrize("training", [False, True])
def test_the_split_trains_in_the_mode_the_model_came_in(training: bool) -> None:
    """A model in eval mode (as from_pretrained returns it) stays in it everywhere, its own
    code's dropout too, after an eval pass of pipeswap's (which restores the modes)."""
    model = _Dropped().train(training)
    layered = adapt(model, example=torch.randint(0, 32, (1, 6)))
    with evaluating(layered):
        assert not model.drop.training
    modes = {m.training for m in [layered, *layered.modules(), *model.modules()]}
    assert modes == {training}


class _Routed(_Block):
    def __init__(self, routed: list[torch.Tensor]) -> None:
        super().__init__()
        self.routed = routed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.routed.append(x.mean(-1))  # its router's logits, kept for the auxiliary loss
        return super().forward(x)


class _RouterLogits(nn.Module):
    """Blocks that leave a side output the code after them reads (as a mixture of experts
    collects its router logits for an auxiliary loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.routed: list[torch.Tensor] = []
        self.embed = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList(_Routed(self.routed) for _ in range(2))
        self.out = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.routed.clear()
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.out(h) + torch.stack(self.routed).mean()


def test_code_after_the_blocks_that_reads_their_side_outputs_is_refused_saying_why() -> None:
    with pytest.raises(PipeswapError, match="output_router_logits=False"):
        adapt(_RouterLogits(), example=torch.randint(0, 32, (1, 6)))
