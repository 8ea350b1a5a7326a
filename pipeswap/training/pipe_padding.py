"""A batch's ``attention_mask`` in a pipeline: honoured where it changes nothing scored.

A pipeline's stages pass one tensor between them, so the model runs without the mask. That
gives the loss of the user's ``model(input_ids, attention_mask=mask, labels=labels)`` exactly
where no scored position sees the padding: a causal language model (each position attends
to the ones before it) whose rows are padded on the right and whose padded positions are
not scored. Anything else — padding on the left, a model that attends both ways (BERT) or
pools the sequence (a classifier), a model whose forward takes no mask, padding scored —
would train on another loss, so it is refused, saying what to pass instead.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError, require
from pipeswap.models.base import IGNORE_INDEX
from pipeswap.models.scored import shifts_labels

__all__ = ["attends_causally", "check_padding", "given_inputs"]

# What a collator's batch may hold besides what pipe.step takes, and why it cannot go in.
_WHY_NOT = {
    "token_type_ids": "changes the embeddings of a model that reads it (GPT-2 adds a type "
    "embedding even for zeros; BERT's default is zeros)",
    "position_ids": "sets positions the model otherwise counts from 0 (what right padding keeps)",
}


def given_inputs(
    inputs: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    pixel_values: torch.Tensor | None,
    other: dict[str, Any],
) -> torch.Tensor:
    """The batch's inputs, given positionally or by a Hugging Face name (``pipe.step(**batch)``
    with a collator's or an image processor's batch); ``other`` keys of the batch are
    refused, saying why: the stages carry the inputs alone."""
    if other:
        why = "; ".join(f"{key} {_WHY_NOT[key]}" for key in other if key in _WHY_NOT)
        raise ConfigError(
            f"pipe.step takes input_ids (or pixel_values), attention_mask and labels (or "
            f"target), not {', '.join(sorted(other))}: a pipeline's stages carry the inputs "
            "alone. Drop them from the batch (batch.pop(...)) where your plain loop runs the "
            "same without them" + (f". Mind: {why}" if why else "")
        )
    given = [t for t in (inputs, input_ids, pixel_values) if t is not None]
    require(
        len(given) == 1,
        "pass the batch's inputs once: positionally, as input_ids= or as pixel_values= "
        f"({len(given)} given)",
    )
    return given[0]


def check_padding(
    model: nn.Module,
    inputs: torch.Tensor,
    mask: torch.Tensor | None,
    scored: torch.Tensor,
    shifted: bool,
) -> None:
    """Refuse an ``attention_mask`` that would make the maskless run score another loss.

    ``model`` is the user's own module; ``scored`` the call's labels or target, compared
    with the mask after the model's own shift (``shifted``: labels of a causal LM, whose
    position ``i`` is scored against label ``i + 1``).
    """
    if mask is None:
        return
    require(
        tuple(mask.shape) == tuple(inputs.shape[:2]),
        f"attention_mask has shape {tuple(mask.shape)} for inputs of shape "
        f"{tuple(inputs.shape)}: pass one 0/1 entry per token, [batch, seq_len]",
    )
    pads = mask == 0
    if not bool(pads.any()):
        return  # a mask of ones: the model runs the same without it
    name = type(model).__name__
    require(
        "attention_mask" in inspect.signature(model.forward).parameters,
        f"attention_mask pads some tokens, but {name}'s forward takes no attention_mask: "
        "your own loop cannot pass one either; drop it (pipe.step(ids, ...))",
    )
    require(
        shifts_labels(model) and attends_causally(model),
        f"attention_mask pads some tokens, and what {name} scores depends on the padding "
        "(it attends both ways, or pools the sequence): pipelines run without a mask; pass "
        "batches without padding (pack sequences, or group them by length)",
    )
    before = pads[:, :-1] & ~pads[:, 1:]  # a pad followed by a token
    rows = before.any(dim=1).nonzero().flatten().tolist()
    row = rows[0] if rows else 0
    where = "on the left" if bool(pads[row, 0]) else "between its tokens"
    require(
        not rows,
        f"attention_mask pads row {row} {where}: a pipeline runs without a mask, so the "
        "tokens after the padding would attend to it; pad on the right only "
        "(tokenizer.padding_side = 'right') with labels -100 there",
    )
    # Position i's output differs from the masked run's only where i is padding.
    seen = (
        pads[:, :-1] & (scored[:, 1:] != IGNORE_INDEX)
        if shifted
        else pads & (scored[:, : pads.shape[1]] != IGNORE_INDEX)
    )
    rows = seen.any(dim=1).nonzero().flatten().tolist()
    given = "labels" if shifted else "target"
    require(
        not rows,
        f"row {rows[:1][0] if rows else 0}'s {given} score padded positions, which a pipeline "
        f"runs without the mask: set the {given} of padding to {IGNORE_INDEX} (as "
        "DataCollatorForLanguageModeling does)",
    )


def attends_causally(model: nn.Module) -> bool:
    """Whether each position of ``model`` attends to the ones before it only, as its
    attention modules say (Hugging Face's ``is_causal``); False where none says so. A
    causal LM's loss alone is no proof: BERT's LM head without ``is_decoder`` attends both
    ways."""
    said = [m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)]
    return bool(said) and all(said)
