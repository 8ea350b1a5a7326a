"""An encoder-decoder as one module on packed batches: its blocks, its own loss, its refusals.

Covers: pipeswap/models/seq2seq.py and the encoder-decoder entries of the registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.models.export import source_module
from pipeswap.models.registry import build_model, model_spec
from pipeswap.models.seq2seq import is_encoder_decoder, load_seq2seq
from tests.models.hf_configs import save_config
from tests.models.seq2seq_dirs import save_seq2seq

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("family", "first", "last"),
    [
        ("t5", "model.encoder.block.0", "model.decoder.block.1"),
        ("bart", "model.model.encoder.layers.0", "model.model.decoder.layers.1"),
    ],
)
def test_blocks_are_the_encoders_then_the_decoders_and_the_loss_is_the_models_own(
    tmp_path: Path, family: str, first: str, last: str
) -> None:
    directory = save_seq2seq(tmp_path / family, family)
    assert is_encoder_decoder(directory)
    model = load_seq2seq(directory).eval()
    assert model.layer_names[0] == first and model.layer_names[-1] == last
    assert len(model.layer_names) == 4 and source_module(model) is model.model
    pad = model.pad_token_id
    ids = torch.tensor([[5, 6, 7, pad], [8, 9, pad, pad]])
    mask = (ids != model.pad_token_id).long()
    labels = torch.tensor([[10, 11, -100, -100], [12, 13, 14, -100]])
    packed = torch.stack([ids, mask, labels], dim=1)  # [2, 3, 4]
    with torch.no_grad():
        mine = model(packed)
        own = model.model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.equal(mine, own) and model.loss(mine, labels) is mine
    spec = model_spec(directory)
    assert spec.encoder_decoder and spec.task == "lm" and spec.default_seq_len is not None


def test_what_is_not_an_encoder_decoder_with_a_head_is_refused(tmp_path: Path) -> None:
    assert not is_encoder_decoder(save_config(tmp_path / "gpt2", "gpt2"))
    assert not is_encoder_decoder(str(tmp_path / "missing"))
    t5 = save_seq2seq(tmp_path / "t5", "t5")
    with pytest.raises(ConfigError, match="pipeswap train` trains it data-parallel"):
        build_model(t5, device="meta")  # no stack of layers to cut
    config = json.loads((Path(t5) / "config.json").read_text())
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    headless = {**config, "architectures": ["T5EncoderModel"], "is_encoder_decoder": True}
    (classifier / "config.json").write_text(json.dumps(headless))
    with pytest.raises(PipeswapError, match="without a language-model head"):
        load_seq2seq(str(classifier), device="meta")
    unstarted = tmp_path / "unstarted"
    unstarted.mkdir()
    (unstarted / "config.json").write_text(json.dumps({**config, "decoder_start_token_id": None}))
    with pytest.raises(PipeswapError, match="sets no decoder_start_token_id"):
        load_seq2seq(str(unstarted), device="meta")
