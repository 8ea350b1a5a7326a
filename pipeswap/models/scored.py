"""What a model's own loss averages over: its labels' scored items, counted as it counts them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeswap.models.base import IGNORE_INDEX

__all__ = ["own_loss_count", "scored_targets", "shifts_labels"]

# Hugging Face's losses (transformers.loss.loss_utils) that average cross-entropy over the
# labels that are not IGNORE_INDEX: a causal LM's after shifting them one to the left.
_SHIFTED = {"ForCausalLMLoss"}
_IN_PLACE = {"ForMaskedLMLoss", "ForTokenClassification", "ForSequenceClassificationLoss"}


def scored_targets(target: torch.Tensor) -> int:
    """The targets pipeswap's cross-entropy scores: those that are not IGNORE_INDEX."""
    return int((target != IGNORE_INDEX).sum())


def _shifted_labels(labels: torch.Tensor) -> int:
    return scored_targets(labels[..., 1:])


def own_loss_count(model: nn.Module) -> Callable[[torch.Tensor], int] | None:
    """How the loss a Hugging Face ``model`` computes from ``labels`` counts its items, or
    None where that is not known (a model computing a loss of its own kind)."""
    try:
        loss_function = getattr(model, "loss_function", None)
    except Exception:  # noqa: BLE001 - a property of the model's own code
        return None
    name = getattr(loss_function, "__name__", None)
    if name in _SHIFTED:
        return _shifted_labels
    if name in _IN_PLACE:
        return scored_targets
    return None


def shifts_labels(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal language model: its loss scores position
    ``i`` against label ``i + 1``, and each position attends to the ones before it only."""
    return own_loss_count(model) is _shifted_labels
