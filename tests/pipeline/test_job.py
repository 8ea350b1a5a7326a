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
