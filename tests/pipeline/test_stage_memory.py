"""The executor's side of StageMemory: each stage's keeper sees every unit's forward, what
the stage holds anyway, every compute action's end and every backward's end, in its
schedule's order.

Covers: pipeswap/pipeline/stage_memory.py (and its calls in pipeswap/pipeline/executor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from support import pipeline_run
from torch import nn

from pipeswap.pipeline.emulator import Emulator, pipeline_schedule
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.stage_memory import StageMemory
from pipeswap.schedule.actions import ActionKind
from pipeswap.swap.runtime.unit_swapper import UnitSwapper


class Recorder:
    """A StageMemory that keeps everything and writes down what it is told."""

    def __init__(self, stage: int, log: list[tuple[Any, ...]]) -> None:
        self.stage, self.log = stage, log
        self.named = 0

    @contextmanager
    def forward(self, unit: int, forward_loss: Callable[[], Any] | None = None) -> Iterator[None]:
        if forward_loss is not None and self.named == 0:
            forward_loss()  # a forward of the unit's shapes that keeps nothing
            self.named += 1
        self.log.append((self.stage, "F", unit))
        yield

    def keep(self, tensors: Sequence[torch.Tensor]) -> None:
        self.log.append((self.stage, "keep", len(tensors)))

    def after_action(self, index: int) -> None:
        self.log.append((self.stage, "end", index))

    def after_backward(self, unit: int) -> None:
        self.log.append((self.stage, "B", unit))

    def stats(self) -> dict[str, Any]:
        return {"events": sum(1 for e in self.log if e[0] == self.stage)}

    def close(self) -> None:
        self.log.append((self.stage, "closed"))


def test_every_stage_tells_its_keeper_each_pass_in_schedule_order() -> None:
    config = resolve_pipeline(
        pipeline_run("gpt2-micro", (2, 2), batch=4, steps=2, seq_len=16, micro_batches=2)
    )
    log: list[tuple[Any, ...]] = []
    keepers: dict[int, Recorder] = {}

    def build(stage: int, module: nn.Module) -> StageMemory:
        keepers[stage] = Recorder(stage, log)
        return keepers[stage]

    result = Emulator(config, memory=build).run()
    plain = Emulator(config).run()
    assert result.params_sha256 == plain.params_sha256  # a keeper that keeps changes nothing
    schedule = pipeline_schedule(config)
    for stage in (0, 1):
        mine = [e[1:] for e in log if e[0] == stage]
        expected: list[tuple[Any, ...]] = []
        for index, action in enumerate(schedule.actions[stage]):
            if action.kind is ActionKind.F:
                # Stage 0 holds the outputs it sent; stage 1 its input leaf and its loss.
                expected += [("F", action.unit), ("keep", 1 if stage == 0 else 2)]
            elif action.kind is ActionKind.B:
                expected.append(("B", action.unit))
            if action.is_compute:
                expected.append(("end", index))
        assert mine == [*expected, ("closed",)], stage
        assert keepers[stage].named == 1


def test_the_unit_swapper_is_a_stage_memory() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    keeper: StageMemory = UnitSwapper(model, ["0"], capacity=1)  # checked by mypy
    assert callable(keeper.keep) and callable(keeper.after_action)
