"""Held-out batches through a stage: every ``eval_every`` steps and after training."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from pipeswap.metrics import HeldOutSums, StepLog
from pipeswap.pipeline.rng import EVAL
from pipeswap.pipeline.stage import Packed, StageRunner
from pipeswap.pipeline.stage_result import StageResult
from pipeswap.schedule.actions import ActionKind
from pipeswap.train_config import TrainConfig

__all__ = ["HeldOutScorer", "Sender"]


class Sender(Protocol):
    def send(self, direction: ActionKind, unit: int, tensors: Packed) -> None: ...


class HeldOutScorer:
    """One stage's side of scoring the held-out batches: forwards them without gradients,
    passes them on, and on the last stage sums their losses (``scored``). Each scoring
    runs its own range of units past the training ones, so its transfers never meet
    another's."""

    def __init__(
        self,
        config: TrainConfig,
        runner: StageRunner,
        result: StageResult,
        inputs_of: Callable[[int, int, int], tuple[Any, torch.Tensor | None]],
        stream: Callable[[str, int, int], AbstractContextManager[None]],
        transport: Sender,
        *,
        num_units: int,
        classify: bool,
        log: StepLog | None,
    ) -> None:
        self.config, self.runner, self.result = config, runner, result
        self.inputs_of, self.stream, self.transport = inputs_of, stream, transport
        self.num_units, self.classify, self.log = num_units, classify, log
        self.micro_batches = config.require_pipeline().micro_batch_count
        self.per_round = config.dataset.eval_batches * self.micro_batches
        self.scored = HeldOutSums()

    def units(self, step: int | None = None) -> list[int]:
        """The units of the held-out batches scored after UPDATE(``step``), or (None)
        after training."""
        base = self.num_units
        if step is not None:
            base += self.per_round * ((step + 1) // self.config.dataset.eval_every)
        return list(range(base, base + self.per_round))

    def evaluate(self, unit: int) -> None:
        """Forward one held-out unit (no gradients) and pass it on or score it."""
        step, micro = divmod((unit - self.num_units) % self.per_round, self.micro_batches)
        inputs, target = self.inputs_of(step, micro, unit)
        with self.stream(EVAL, step, micro):
            out = self.runner.evaluate(inputs, target)
        if self.runner.is_last:
            loss, correct = out
            assert target is not None
            self.scored += HeldOutSums(1, float(loss), int(correct), int(target.shape[0]))
        else:
            self.transport.send(ActionKind.F, unit, out)  # type: ignore[arg-type]

    def _score(self) -> dict[str, float | int]:
        return self.scored.score(self.config.dataset.eval_batches, classify=self.classify)

    def score_if_due(self, step: int) -> None:
        """After UPDATE(``step``), when a scoring is due: this stage's side of all of it."""
        if self.config.dataset.eval_due(step, self.config.steps):
            for unit in self.units(step):
                self.evaluate(unit)
            self.score_round(step)

    def score_round(self, step: int) -> None:
        """The last stage records the score of the units just scored (the step's end logs it)."""
        if self.runner.is_last:
            self.result.evals.append((step + 1, self._score()))
        self.scored = HeldOutSums()

    def close_log(self) -> None:
        """After the held-out batches of the end: their score closes the log."""
        if self.log is not None:
            self.log.close(self._score())
