"""pipeswap/training/pipe_target.py: what a user's pipeline scores against, chosen once.

A held-out batch through the stages (score_batch) is tested end to end by
tests/training/test_pipe.py (pipe.eval on one and two stages)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.models.adapt import adapt
from pipeswap.training.pipe_target import ScoredAgainst
from tests.models.tiny_lm import TinyLM


def test_the_first_call_chooses_target_or_labels_and_later_ones_keep_to_it() -> None:
    scored = ScoredAgainst(adapt(TinyLM()), loss_fn=None)
    x = y = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(PipeswapError, match="one of them"):
        scored.choose(x, None, None)
    with pytest.raises(PipeswapError, match="one of them"):
        scored.choose(x, y, y)
    with pytest.raises(ConfigError, match="computes none: pass target="):
        scored.choose(x, None, y)  # a plain module has no loss of its own
    assert scored.choose(x, y, None) is y and scored.own_loss is False
    with pytest.raises(ConfigError, match="first called with target=; keep to it"):
        scored.choose(x, None, y)


def test_labels_and_a_loss_function_of_the_user_s_are_refused_together() -> None:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    model = transformers.GPT2LMHeadModel(hf_config("gpt2"))
    labels = torch.zeros(2, 8, dtype=torch.long)
    loss: nn.Module = nn.CrossEntropyLoss()
    with pytest.raises(ConfigError, match="labels= scores with the model's own loss"):
        ScoredAgainst(adapt(model), loss_fn=lambda out, y: loss(out, y)).choose(
            labels, None, labels
        )
    chosen = ScoredAgainst(adapt(model), loss_fn=None)
    assert chosen.choose(labels, None, labels) is labels and chosen.own_loss is True


def test_a_target_with_other_rows_than_the_inputs_is_refused() -> None:
    """A loader whose labels run longer than its inputs would be cut silently."""
    scored = ScoredAgainst(adapt(TinyLM()), loss_fn=None)
    x = torch.zeros(4, 8, dtype=torch.long)
    with pytest.raises(ConfigError, match="target has 6 rows for 4 rows of inputs"):
        scored.choose(x, torch.zeros(6, 8, dtype=torch.long), None)
