"""pipeswap/models/replay.py: replay splitting of a plain module, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.export import source_module
from pipeswap.models.registry import build_model
from pipeswap.models.replay import split_at_blocks
from tests.models.tiny_lm import TinyLM


def test_replay_passes_the_context_and_the_input_along() -> None:
    torch.manual_seed(0)
    net = TinyLM()
    ids = torch.randint(0, 256, (2, 8))
    model = split_at_blocks(net, example=ids[:1], task="lm", name="tiny", vocab_size=256)
    packed = model.get_submodule("embed")(ids)
    # hidden state, the scale tensor every block receives, the input ids
    assert len(packed) == 3 and packed[2] is ids
    assert torch.equal(packed[1], (ids[..., None] % 3 + 1).float() / 3)
    assert torch.equal(model(ids), net(ids))
    assert net.training  # inspection ran in eval mode and put the mode back


def test_a_block_called_twice_is_refused() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids)
            for block in [*self.blocks, self.blocks[0]]:
                h = block(h)
            return h

    with pytest.raises(PipeswapError, match="calls exactly once"):
        split_at_blocks(Twice(), example=torch.zeros(1, 4, dtype=torch.long), task="lm", name="t")


def test_code_that_transforms_the_hidden_state_between_blocks_is_refused() -> None:
    with pytest.raises(PipeswapError, match="feed each other directly"):
        split_at_blocks(
            TinyLM(skip=True), example=torch.zeros(1, 4, dtype=torch.long), task="lm", name="t"
        )


def test_modes_and_batchnorm_statistics_follow_the_model_as_its_own_forward_has_them(
    tmp_path: Path,
) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import save_model

    directory = save_model(tmp_path / "resnet", "resnet")
    layered = build_model(directory)
    plain = transformers.AutoModelForImageClassification.from_pretrained(
        directory, local_files_only=True
    )
    # eval()/train() reach the modules outside the blocks that no layer owns (the root).
    layered.eval()
    assert not any(m.training for m in source_module(layered).modules())
    layered.train()
    plain.train()
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layered(images)
        plain(pixel_values=images)
    # The head re-runs the model's code around the blocks, but the embedder's BatchNorm
    # counts this batch once, as the model's own forward does.
    ours = dict(source_module(layered).named_buffers())
    for name, buffer in plain.named_buffers():
        assert torch.equal(ours[name], buffer), name


class _ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.conv(h))


class _StemSkipCNN(nn.Module):
    """A stem (conv, BatchNorm) whose output skips past every block into the head, a
    dropout before the blocks and one after, and a step counter its forward keeps before
    the first block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.bn0, self.drop = (
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.Dropout(0.2),
        )
        self.blocks = nn.ModuleList(_ConvBlock() for _ in range(3))
        self.fc = nn.Linear(8, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h0 = torch.relu(self.bn0(self.stem(x)))
        x = self.drop(x)  # a draw before the blocks, its output dropped
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.fc(self.drop((h + h0).mean((2, 3))))


def test_the_head_s_rerun_of_the_code_before_the_blocks_leaves_no_trace() -> None:
    """In training: the head re-runs the stem in its own mode (the long skip reads the
    batch-normalised stem, not its running statistics), the buffers it updates count the
    batch once, and the random draws after the blocks are the model's own: forward for
    forward, the adapted model computes what the model does, and ends in the same state."""
    import copy

    model = _StemSkipCNN().train()
    plain = copy.deepcopy(model)
    layered = split_at_blocks(
        model, example=torch.zeros(2, 3, 8, 8), task="classify", name="cnn", num_classes=5
    ).train()
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        images = torch.randn(4, 3, 8, 8, generator=generator)
        torch.manual_seed(7)
        ours, our_state = layered(images), torch.get_rng_state()
        torch.manual_seed(7)
        theirs, their_state = plain(images), torch.get_rng_state()
        assert torch.equal(ours, theirs)
        assert torch.equal(our_state, their_state)
    for name, buffer in plain.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name


def test_the_code_after_the_blocks_reads_the_buffers_as_the_model_s_forward_left_them() -> None:
    import copy

    import pipeswap

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 64)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.calls += 1  # bumped before the blocks, read after them
            h = self.emb(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h) * (1.0 + self.calls)

    torch.manual_seed(0)
    model = Net().train()
    own = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 8))
    layered = pipeswap.adapt(model, example=ids[:1])
    for _ in range(2):
        assert torch.equal(layered(ids), own(ids))
    assert model.calls.item() == own.calls.item() == 2
