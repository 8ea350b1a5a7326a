"""pipe.step(**batch) with a padding collator's attention_mask: the loss of the user's
plain loop where the maskless pipeline scores the same, a clear refusal where it would not."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.training.pipe import Pipeline
from pipeswap.training.pipe_padding import attends_causally
from tests.models.tiny_lm import TinyLM

transformers = pytest.importorskip("transformers")


def _model(family: str) -> nn.Module:
    from tests.models.hf_configs import hf_config

    torch.manual_seed(0)
    if family == "bert":
        return transformers.BertForMaskedLM(hf_config("bert"))
    return transformers.LlamaForCausalLM(hf_config("llama"))


def _batches(left: bool = False) -> list[dict[str, torch.Tensor]]:
    """Two batches as a padding collator returns them: rows of 3 to 12 tokens, the mask 0
    and the labels -100 at the padding (on the right, or on the left)."""
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(2):
        ids = torch.randint(5, 200, (4, 12), generator=g)
        lengths = torch.randint(3, 13, (4,), generator=g)
        lengths[0] = 12
        positions = torch.arange(12).expand(4, 12)
        mask = (positions >= 12 - lengths[:, None]) if left else (positions < lengths[:, None])
        ids[~mask] = 0
        labels = ids.masked_fill(~mask, -100)
        batches.append({"input_ids": ids, "attention_mask": mask.long(), "labels": labels})
    return batches


def test_right_padding_of_a_causal_lm_trains_as_the_plain_loop_with_its_mask() -> None:
    model = _model("llama")
    plain = copy.deepcopy(model)
    pipe = Pipeline(
        model, stages=1, steps=2, micro_batches=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5)
    )
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
    for batch in _batches():
        loss = pipe.step(**batch)
        expected = plain(**batch).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    state = pipe.state_dict()
    assert state is not None
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_padding_that_would_change_a_scored_position_is_refused() -> None:
    pipe = Pipeline(_model("llama"), stages=1, steps=2, micro_batches=2)
    left = _batches(left=True)[0]
    with pytest.raises(ConfigError, match="pads row 1 on the left.*padding_side = 'right'"):
        pipe.step(**left)
    holed = _batches()[0]
    holed["attention_mask"][2, 3] = 0  # a hole: tokens on both sides
    with pytest.raises(ConfigError, match="pads row 2 between its tokens.*on the right only"):
        pipe.step(**holed)
    scored = _batches()[0]
    scored["labels"] = scored["input_ids"]  # the padding is scored too
    with pytest.raises(ConfigError, match="row 1's labels score padded positions.*-100"):
        pipe.step(**scored)
    typed = _batches()[0] | {"token_type_ids": torch.zeros(4, 12, dtype=torch.long)}
    with pytest.raises(ConfigError, match="not token_type_ids: .*Mind: token_type_ids changes"):
        pipe.step(**typed)
    short = _batches()[0]
    short["attention_mask"] = short["attention_mask"][:, :5]
    with pytest.raises(ConfigError, match="attention_mask has shape \\(4, 5\\)"):
        pipe.step(**short)
    with pytest.raises(ConfigError, match="inputs once.*2 given"):
        pipe.step(short["input_ids"], input_ids=short["input_ids"], labels=short["labels"])


def test_a_model_that_attends_both_ways_takes_padding_only_of_none() -> None:
    batch = _batches()[0]
    pipe = Pipeline(_model("bert"), stages=1, steps=1, micro_batches=2)
    with pytest.raises(
        ConfigError, match="what BertForMaskedLM scores depends on the padding.*pack"
    ):
        pipe.step(**batch)
    ones = torch.ones_like(batch["attention_mask"])
    assert pipe.step(batch["input_ids"], labels=batch["labels"], attention_mask=ones) is not None


def test_a_model_without_a_mask_argument_refuses_one_that_pads() -> None:
    batch = _batches()[0]
    pipe = Pipeline(TinyLM(), stages=1, steps=1, micro_batches=2)
    with pytest.raises(ConfigError, match="TinyLM's forward takes no attention_mask"):
        pipe.step(
            batch["input_ids"], target=batch["labels"], attention_mask=batch["attention_mask"]
        )


def test_causal_attention_is_what_the_attention_modules_say_not_the_loss() -> None:
    from tests.models.hf_configs import hf_config

    assert attends_causally(_model("llama")) and not attends_causally(_model("bert"))
    assert not attends_causally(TinyLM())  # nothing says so: padding is refused
    # BERT's LM head scores as a causal LM does, but without is_decoder attends both ways.
    both_ways = transformers.BertLMHeadModel(hf_config("bert"))
    assert not attends_causally(both_ways)
    pipe = Pipeline(both_ways, stages=1, steps=1, micro_batches=2)
    with pytest.raises(ConfigError, match="what BertLMHeadModel scores depends on the padding"):
        pipe.step(**_batches()[0])
    assert attends_causally(transformers.BertLMHeadModel(hf_config("bert", is_decoder=True)))
