"""pipeswap/models/scored.py: how a model's own loss counts what it averages over."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.models.scored import own_loss_count, scored_targets


def test_pipeswap_s_cross_entropy_counts_the_targets_that_are_scored() -> None:
    assert scored_targets(torch.tensor([[1, -100, 3], [-100, -100, 0]])) == 3


@pytest.mark.parametrize(("family", "shifted"), [("gpt2", True), ("llama", True), ("bert", False)])
def test_a_hugging_face_loss_counts_as_its_family_scores(family: str, shifted: bool) -> None:
    """A causal LM scores labels[:, 1:] (it shifts them); a masked LM scores them in place.
    Checked against the model's own loss: its sum over a batch's rows, each weighted by
    its count, is the count-weighted mean."""
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    classes = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "bert": transformers.BertForMaskedLM,
    }
    torch.manual_seed(0)
    model = classes[family](hf_config(family)).eval()
    count = own_loss_count(model)
    assert count is not None
    labels = torch.randint(5, 100, (2, 8))
    labels[0, 3:] = -100
    assert count(labels) == (3 - 1 + 7 if shifted else 3 + 8)
    ids = labels.clamp(min=0)
    with torch.no_grad():
        rows = [model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss for i in range(2)]
        whole = model(input_ids=ids, labels=labels).loss
    counts = [count(labels[i : i + 1]) for i in range(2)]
    mixed = sum(loss * n for loss, n in zip(rows, counts)) / sum(counts)
    torch.testing.assert_close(mixed, whole)


def test_a_model_without_a_known_loss_has_no_count() -> None:
    assert own_loss_count(nn.Linear(2, 2)) is None
