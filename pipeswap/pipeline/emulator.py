"""Every stage in one process, running exactly the runtime's schedule and weight versions."""

from __future__ import annotations

import time

import torch

from pipeswap.checkpoint import CheckpointPlan, RunStopped, load_rank
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import single_threaded
from pipeswap.pipeline.actions import ActionKind
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.job import build_full_model, save_trained
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.result import PipelineResult, combine
from pipeswap.pipeline.schedule import Schedule, build_schedule, unit_time_order
from pipeswap.pipeline.shared import MailboxExchange
from pipeswap.pipeline.snapshot import StageAtCut, StopRequest
from pipeswap.pipeline.stage import Packed, inspect_layers
from pipeswap.pipeline.validate import validate
from pipeswap.progress import progress_bar
from pipeswap.train_config import TrainConfig


class MailboxTransport:
    """Transfers as copies through a dict shared by all stages (what a wire would deliver)."""

    def __init__(self, rank: int, mailbox: dict[tuple[ActionKind, int, int], Packed]) -> None:
        self.rank = rank
        self.mailbox = mailbox

    def post(self, direction: ActionKind, unit: int) -> None:
        pass

    def take(self, direction: ActionKind, unit: int) -> Packed:
        return self.mailbox.pop((direction, self.rank, unit))

    def send(self, direction: ActionKind, unit: int, tensors: Packed) -> None:
        dst = self.rank + direction.step
        copies = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in tensors)
        self.mailbox[(direction, dst, unit)] = copies

    def progress(self) -> None:
        pass

    def finish(self) -> None:
        pass


def pipeline_schedule(config: TrainConfig) -> Schedule:
    """The validated schedule of a resolved pipeline run."""
    pipeline = config.require_pipeline()
    schedule = build_schedule(
        pipeline.schedule, pipeline.num_stages, config.steps, pipeline.micro_batch_count
    )
    validate(schedule)
    return schedule


class Emulator:
    """Run a pipeline config in this process; ``record`` keeps the weights each pass saw.

    The config is resolved first (:func:`pipeswap.pipeline.resolve.resolve_pipeline`):
    the model's default shapes, the micro-batch count and the partitioner's balance.

    The result is bit-identical to the distributed runtime's on CPU: same model
    construction, same schedule, same weight versions, same transfers (as copies), one
    intra-op thread.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        record: bool = True,
        keep_gradients: bool = False,
        checkpoint: CheckpointPlan | None = None,
        resume: tuple[str, int] | None = None,
    ) -> None:
        """``checkpoint`` writes every stage's state at its cut (pipeswap.pipeline.snapshot);
        ``resume`` (directory, steps done) continues from such a checkpoint, which the
        multi-process runtime may have written too (the files are the same)."""
        self.config = resolve_pipeline(config)
        self.record = record
        self.keep_gradients = keep_gradients
        self.checkpoint = checkpoint
        self.resume = resume
        self.executors: list[StageExecutor] = []

    def run(self, progress: bool = False) -> PipelineResult:
        config = self.config
        pipeline = config.require_pipeline()
        with single_threaded():
            infos = inspect_layers(config)
            schedule = pipeline_schedule(config)
            model = build_full_model(config)
            mailbox: dict[tuple[ActionKind, int, int], Packed] = {}
            tied_mailbox: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}
            request = None
            if self.checkpoint is not None:
                request = StopRequest(
                    self.checkpoint.directory, pipeline.num_stages, config.steps, decider=True
                )
            self.executors = [
                StageExecutor(
                    config,
                    rank,
                    schedule,
                    model,
                    infos,
                    MailboxTransport(rank, mailbox),
                    record=self.record,
                    keep_gradients=self.keep_gradients,
                    checkpoint=self.checkpoint,
                    stop=request,
                    exchange=MailboxExchange(rank, tied_mailbox),
                )
                for rank in range(pipeline.num_stages)
            ]
            starts = [0] * pipeline.num_stages
            if self.resume is not None:
                folder, done = self.resume
                starts = [ex.restore(load_rank(folder, done, ex.rank)) for ex in self.executors]
            bar = progress_bar(config.steps, "train", enabled=progress)
            if bar is not None and self.resume is not None:
                bar.update(self.resume[1])
            start = time.perf_counter()
            for ex in self.executors:
                ex.start_clock()
            at_cut: set[int] = set()
            faults = [fault_hook(rank) for rank in range(pipeline.num_stages)]
            try:
                for timed in unit_time_order(schedule):
                    if timed.index < starts[timed.rank] or timed.rank in at_cut:
                        continue
                    try:
                        self.executors[timed.rank].run(timed.action)
                    except StageAtCut as cut:
                        at_cut.add(timed.rank)
                        if len(at_cut) == pipeline.num_stages:
                            assert self.checkpoint is not None
                            raise RunStopped(self.checkpoint.directory, cut.args[0]) from None
                    fault = faults[timed.rank]
                    if timed.action.kind is not ActionKind.UPDATE:
                        continue
                    if fault is not None:
                        fault(timed.action.unit)
                    if timed.rank == 0 and bar is not None:
                        last = self.executors[-1].runner.losses
                        step_loss = last.get(
                            (timed.action.unit + 1) * pipeline.micro_batch_count - 1
                        )
                        bar.set_postfix(loss=f"{step_loss:.4f}" if step_loss is not None else "-")
                        bar.update(1)
            finally:
                if request is not None:
                    request.close()
            for ex in self.executors:
                ex.finish_training()
            wall = time.perf_counter() - start
            if bar is not None:
                bar.close()
            for unit in self.executors[0].eval_units():
                for ex in self.executors:
                    ex.evaluate(unit)
            stages = [ex.finish() for ex in self.executors]
        save_trained(config, [stage.state for stage in stages])
        return combine(config, stages, mode="emulate", task=model.task, wall_s=wall)
