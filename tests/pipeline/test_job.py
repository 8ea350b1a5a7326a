"""pipeswap/pipeline/job.py: every rank builds the same model and the same batches."""

from __future__ import annotations

import torch
from support import pipeline_run

from pipeswap.pipeline.job import BatchSource, build_full_model, build_meta_model


def test_every_rank_builds_the_same_weights_and_batches() -> None:
    config = pipeline_run("gpt2-micro", (2, 2), batch=4, seq_len=16, micro_batches=2)
    a, b = build_full_model(config), build_full_model(config)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert build_meta_model(config).layer_names == a.layer_names
    source = BatchSource(config, a)
    inputs, targets = source.batch(3)
    assert inputs.shape == (4, 16) and torch.equal(source.batch(3)[0], inputs)
    first, _ = source.micro(3, 1)
    assert torch.equal(first, inputs[2:4])
    held_out, _ = BatchSource(config, a, "val").batch(3)
    assert not torch.equal(held_out, inputs)


def test_a_user_model_no_built_in_data_fits_trains_on_random_batches_only_saying_so() -> None:
    import pytest

    from pipeswap.config_fields import replace_fields

    config = replace_fields(
        pipeline_run("gpt2-micro", (2, 2), batch=4, seq_len=16, micro_batches=2),
        model="pipeline_toys:toy_tied_lm_nodrop",  # a vocabulary of 64: bytes do not fit
    )
    model = build_full_model(config)
    with pytest.warns(UserWarning, match="vocabulary of 64 tokens.*trains on random example"):
        source = BatchSource(config, model)
    inputs, _ = source.batch(0)
    assert int(inputs.max()) < 64


def test_the_model_s_own_buffer_comes_from_its_first_stage_saying_the_copies_differ() -> None:
    import pytest
    from torch import nn

    import pipeswap
    from pipeswap.pipeline.job import load_stage_tensors

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
            self.head = nn.Linear(16, 64)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.seen += ids.numel()  # updated before the blocks: by the first stage
            h = self.emb(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    layered = pipeswap.adapt(Net(), example=torch.zeros(1, 4, dtype=torch.long))
    state = {name: t.clone() for name, t in layered.state_dict().items()}
    first = {n: t for n, t in state.items() if not n.startswith("head")}
    last = {n: t for n, t in state.items() if n.startswith("head")}
    first["embed.seen"] = torch.tensor(32.0)  # the last stage's copy stayed 0
    with pytest.warns(UserWarning, match="own seen differ between the first stage and the last"):
        load_stage_tensors(layered, [first, last])
    assert float(layered.state_dict()["embed.seen"]) == 32.0
