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
