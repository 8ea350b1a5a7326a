"""What a user's pipeline scores: against the batch's target or its labels, and a held-out batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pipeswap.config_fields import require
from pipeswap.errors import PipeswapError
from pipeswap.loss_share import ItemCount, LossShares, shares_of, weighted_loss
from pipeswap.models.base import LayeredModel
from pipeswap.models.export import replay_of, source_module
from pipeswap.models.scored import own_loss_count, scored_targets
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.rng import EVAL
from pipeswap.schedule.actions import ActionKind
from pipeswap.training.pipe_padding import check_padding

__all__ = ["ScoredAgainst", "check_open_batch", "score_batch"]


class ScoredAgainst:
    """``labels`` go to the model's own forward, which computes its own loss (shifted or
    not, as the family does); ``target`` is scored by cross-entropy of the logits (or the
    user's ``loss_fn``). A pipeline's first call chooses one; every later call keeps it."""

    def __init__(
        self, model: LayeredModel, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None
    ) -> None:
        self.model, self.loss_fn = model, loss_fn
        self.own_loss: bool | None = None  # labels= (the model's own loss) or target=

    def choose(
        self,
        inputs: torch.Tensor,
        target: torch.Tensor | None,
        labels: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The call's target or labels, refused when it gives both, neither, the other one
        than the first call, or not one row per input row; and an ``attention_mask`` whose
        padding would change a scored position (pipeswap.training.pipe_padding)."""
        if (target is None) == (labels is None):
            raise PipeswapError("pass the batch's target or its labels (one of them)")
        own = labels is not None
        if self.own_loss is None:
            replay = replay_of(self.model)
            require(
                not own or (replay is not None and replay.input_name is not None),
                "labels= hands the labels to a Hugging Face model's own loss; this model "
                "computes none: pass target= (cross-entropy of its logits)",
            )
            require(
                not own or self.loss_fn is None,
                "labels= scores with the model's own loss, loss_fn with yours: pass target= "
                "with loss_fn, or drop loss_fn",
            )
            self.own_loss = own
        require(
            own == self.own_loss,
            f"this pipeline was first called with {'labels' if self.own_loss else 'target'}=; "
            "keep to it (the loss would change meaning)",
        )
        chosen = labels if labels is not None else target
        assert chosen is not None
        given = "labels" if own else "target"
        require(
            chosen.dim() >= 1 and len(chosen) == len(inputs),
            f"{given} has {len(chosen) if chosen.dim() else 0} rows for {len(inputs)} rows of "
            f"inputs: pass one {given} row per input row",
        )
        check_padding(source_module(self.model), inputs, attention_mask, chosen, own)
        return chosen

    def wire(self, executor: StageExecutor) -> None:
        """Score with the model's own loss on the last stage when the calls give labels:
        its own copy of the model's head (a stage holding a tied weight has a copy of its
        layers) computes it from the labels."""
        replay = replay_of(executor.module)
        runner = executor.runner
        if not runner.is_last:
            return
        if self.own_loss and replay is not None:
            runner.labelled = replay.labelled
            runner.loss_fn = lambda _logits, _labels: replay.own_loss()
        fed = executor.train_data
        runner.shares = LossShares(
            self.item_count(), lambda step: fed.batches[step][1], executor.micro_batches
        )

    def item_count(self) -> ItemCount | None:
        """How the loss counts what it averages over: the model's own loss as its family
        counts, pipeswap's cross-entropy its targets that are not IGNORE_INDEX; a user's
        ``loss_fn`` is not known (pipeswap.loss_share)."""
        if self.own_loss:
            return own_loss_count(source_module(self.model))
        return scored_targets if self.loss_fn is None else None


def check_open_batch(
    inputs: torch.Tensor | None, closed: bool, what: str = "step (or pipe.eval)"
) -> None:
    """Refuse a call on a closed pipeline, and inputs that are no batch."""
    require(
        not closed,
        f"pipe.{what} after pipe.close(), which freed its process groups: call it before "
        "closing (pipe.state_dict, then pipe.close)",
    )
    require(
        inputs is None or inputs.dim() >= 2,
        f"inputs of shape {tuple(inputs.shape) if inputs is not None else ()} are no batch: "
        "pass [batch, seq_len] token ids or [batch, channels, height, width] images (one "
        "sample: inputs[None])",
    )


def score_batch(
    executor: StageExecutor,
    inputs: torch.Tensor,
    target: torch.Tensor,
    scoring: int,
    device: torch.device,
    count: ItemCount | None = None,
) -> float | None:
    """The loss of a held-out batch through every stage, this stage's side of it: the
    mean of its micro-batches' losses on the last stage, None elsewhere. ``scoring``
    counts the batches scored before: each has its own units on the stages' held-out
    transport, so its transfers never meet another's."""
    runner, transport = executor.runner, executor.eval_transport
    micro = executor.micro_batches
    size = len(inputs) // micro
    losses: list[float] = []
    shares = shares_of(target.chunk(micro), count) if runner.is_last else None
    for m in range(micro):
        unit = scoring * micro + m
        part = slice(m * size, (m + 1) * size)
        value: Any = (
            inputs[part].to(device) if runner.is_first else transport.take(ActionKind.F, unit)
        )
        with executor.stream(EVAL, scoring, m):
            out = runner.evaluate(value, target[part].to(device))
        if runner.is_last:
            losses.append(float(out[0]) if shares is None or shares[m].items else 0.0)
        else:
            transport.send(ActionKind.F, unit, out)  # type: ignore[arg-type]
    transport.finish()
    return weighted_loss(losses, shares) if runner.is_last else None
