"""Every stage in one process, running exactly the runtime's schedule and weight versions."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from pipeswap.checkpoint import CheckpointPlan, RunStopped, load_rank
from pipeswap.config_fields import require
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import single_threaded
from pipeswap.metrics import StepLog
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.job import build_full_model, save_trained
from pipeswap.pipeline.replica_average import EmulatedReplicas
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.result import PipelineResult, combine
from pipeswap.pipeline.shared import MailboxExchange
from pipeswap.pipeline.snapshot import StageAtCut, StopRequest
from pipeswap.pipeline.stage import Packed, inspect_layers
from pipeswap.pipeline.stage_memory import MemoryFactory
from pipeswap.pipeline.stage_meter import StageMeter, metered_steps
from pipeswap.pipeline.stage_restore import restore_stage
from pipeswap.progress import progress_bar
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.timetable import Schedule, TimedAction, build_schedule, unit_time_order
from pipeswap.schedule.validate import validate
from pipeswap.train_config import TrainConfig

__all__ = ["Emulator", "MailboxTransport", "pipeline_schedule"]


class MailboxTransport:
    """Transfers as copies through a dict shared by all stages (what a wire would deliver).

    With ``meters`` (the stages' meters, by stage), a copy counts on the stage it is sent to."""

    def __init__(
        self,
        stage: int,
        mailbox: dict[tuple[ActionKind, int, int], Packed],
        meters: Sequence[StageMeter] = (),
    ) -> None:
        self.stage = stage
        self.mailbox = mailbox
        self.meters = meters

    def post(self, direction: ActionKind, unit: int) -> None:
        pass

    def take(self, direction: ActionKind, unit: int) -> Packed:
        return self.mailbox.pop((direction, self.stage, unit))

    def send(self, direction: ActionKind, unit: int, tensors: Packed) -> None:
        dst = self.stage + direction.step
        with self.meters[self.stage].aside() if self.meters else nullcontext():
            copies = tuple(t.detach().clone(memory_format=torch.contiguous_format) for t in tensors)
        if self.meters:
            self.meters[dst].received(copies)
        self.mailbox[(direction, dst, unit)] = copies

    def progress(self) -> None:
        pass

    def finish(self) -> None:
        pass


def pipeline_schedule(config: TrainConfig) -> Schedule:
    """The validated schedule of a resolved pipeline run."""
    pipeline = config.require_pipeline()
    return _validated(
        pipeline.schedule, pipeline.num_stages, config.steps, pipeline.micro_batch_count
    )


# A run asks for its schedule from several places (plans, stage swaps, the emulator or
# runtime, the horizon); built and checked once, as it takes seconds at 10^4 steps. It is
# frozen data, so one copy serves them all.
@functools.lru_cache(maxsize=2)
def _validated(name: str, num_stages: int, num_steps: int, micro_batches: int) -> Schedule:
    schedule = build_schedule(name, num_stages, num_steps, micro_batches)
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
        data: Any = None,
        memory: MemoryFactory | None = None,
    ) -> None:
        """``checkpoint`` writes every stage's state at its cut (pipeswap.pipeline.snapshot);
        ``resume`` (directory, steps done) continues from such a checkpoint, which the
        multi-process runtime may have written too (the files are the same). ``data``
        (with ``micro(step, m)``, as pipeline.feed.FedBatches) replaces the config's
        training batches: what pipeswap.Pipeline was fed, for a reference run. ``memory``
        builds each stage's keeper of saved tensors (stages that swap)."""
        self.config = resolve_pipeline(config)
        self.record = record
        self.keep_gradients = keep_gradients
        self.checkpoint = checkpoint
        self.resume = resume
        self.data = data
        self.memory = memory
        require(
            data is None or self.config.dataset.eval_batches == 0,
            "an emulation of fed batches scores no held-out batches: set {eval_batches} 0",
        )
        self.executors: list[StageExecutor] = []
        # Each stage's device meter (pipeswap.pipeline.stage_meter), by worker.
        self.meters: list[StageMeter] = []
        self._bar: Any = None
        self._request: StopRequest | None = None  # a signal's stop, with checkpoints on

    def run(self, progress: bool = False) -> PipelineResult:
        config = self.config
        pipeline = config.require_pipeline()
        n, replicas = pipeline.num_stages, pipeline.replicas
        with single_threaded(), StepLog(config.log, config.steps) as log:
            infos = inspect_layers(config)
            schedule = pipeline_schedule(config)
            # One model per replica, built alike: a replica is a copy of the whole pipeline.
            models = [build_full_model(config) for _ in range(replicas)]
            model = models[0]
            average = EmulatedReplicas(replicas) if replicas > 1 else None
            request = None
            if self.checkpoint is not None:
                request = StopRequest(self.checkpoint.directory, n, config.steps, decider=True)
            self._request = request
            self.executors = []
            meters: list[list[StageMeter]] = [[] for _ in range(replicas)]
            for replica in range(replicas):
                mailbox: dict[tuple[ActionKind, int, int], Packed] = {}
                tied_mailbox: dict[tuple[int, int, int, int], list[torch.Tensor]] = {}
                self.executors += [
                    StageExecutor(
                        config,
                        stage,
                        schedule,
                        models[replica],
                        infos,
                        MailboxTransport(stage, mailbox, meters[replica]),
                        record=self.record,
                        keep_gradients=self.keep_gradients,
                        checkpoint=self.checkpoint,
                        stop=request,
                        exchange=MailboxExchange(stage, tied_mailbox),
                        log=log if stage == n - 1 and replica == 0 else None,
                        data=(self.data, None)
                        if self.data is not None and stage in (0, n - 1)
                        else None,
                        replica=replica,
                        average=average,
                        memory=self.memory,
                    )
                    for stage in range(n)
                ]
                meters[replica] += [
                    StageMeter(ex, metered_steps(config)) for ex in self.executors[-n:]
                ]
            self.meters = [meter for replica_meters in meters for meter in replica_meters]
            starts = [0] * len(self.executors)
            if self.resume is not None:
                folder, done = self.resume
                starts = [
                    restore_stage(ex, load_rank(folder, done, ex.worker)) for ex in self.executors
                ]
            self._bar = progress_bar(config.steps, "train", enabled=progress)
            if self._bar is not None and self.resume is not None:
                self._bar.update(self.resume[1])
            start = time.perf_counter()
            for ex in self.executors:
                ex.start_clock()
            self._faults = [fault_hook(worker) for worker in range(len(self.executors))]
            self._at_cut: set[int] = set()
            self._held: dict[int, list[tuple[int, int, TimedAction]]] = {}
            try:
                # Replicas in lockstep: each action of the order runs in every replica.
                for seq, timed in enumerate(unit_time_order(schedule)):
                    for replica in range(replicas):
                        worker = replica * n + timed.stage
                        if timed.index >= starts[worker]:
                            self._feed(seq, worker, timed)
            finally:
                if request is not None:
                    request.close()
            for ex in self.executors:
                ex.finish_training()
            wall = time.perf_counter() - start
            if self._bar is not None:
                self._bar.close()
            for unit in self.executors[0].scorer.units():
                for ex in self.executors:
                    ex.scorer.evaluate(unit)
            self.executors[n - 1].scorer.close_log()
            stages = [ex.finish() for ex in self.executors]
            for stage, meter in zip(stages, self.meters, strict=True):
                stage.peak_resident_bytes = meter.peak_bytes
        save_trained(config, [stage.state for stage in stages[:n]])
        resumed = 0 if self.resume is None else self.resume[1]
        return combine(
            config, stages, mode="emulate", task=model.task, wall_s=wall, resumed=resumed
        )

    def _meets(self, step: int) -> bool:
        """Whether the stages meet before UPDATE(``step``) (pipeswap.pipeline.step_end)."""
        config = self.config
        return config.optim.clip_grad_norm is not None or config.dataset.eval_due(
            step, config.steps
        )

    def _feed(self, seq: int, worker: int, timed: TimedAction) -> None:
        """Run the next action of the schedule's order (``seq``) on executor ``worker``
        (replica x stages + stage), or hold it while its stage waits at a meeting for the
        others, as it would in its own process."""
        action = timed.action
        if worker in self._at_cut:
            return
        if worker in self._held:
            self._held[worker].append((seq, worker, timed))
            return
        if action.kind is ActionKind.UPDATE and self._meets(action.unit):
            self._held[worker] = [(seq, worker, timed)]
            if len(self._held) + len(self._at_cut) == len(self.executors):
                self._meet(action.unit)
            return
        self._run(worker, action, end_step=True)

    def _meet(self, step: int) -> None:
        """Every stage waits at UPDATE(``step``): the global norm (of each replica's
        stages), the updates, the held-out scores, the steps' ends; then the actions held
        meanwhile, in the schedule's order."""
        executors, held = self.executors, self._held
        self._held = {}
        n = self.config.require_pipeline().num_stages
        if self.config.optim.clip_grad_norm is not None:
            for first in range(0, len(executors), n):
                replica = executors[first : first + n]
                parts = [ex.squared_norm(step) for ex in replica]
                for ex in replica:
                    ex.norm_parts[step] = parts
        for worker, queue in sorted(held.items()):
            action = queue[0][2].action
            with self.meters[worker].action(action):
                executors[worker].run(action, end_step=False)
        if self.config.dataset.eval_due(step, self.config.steps):
            for unit in executors[0].scorer.units(step):
                for ex in executors:
                    ex.scorer.evaluate(unit)
            for ex in executors:
                ex.scorer.score_round(step)
        for worker in sorted(held):
            self._end_step(worker, step, evaluate=False)
        for seq, worker, timed in sorted(item for queue in held.values() for item in queue[1:]):
            self._feed(seq, worker, timed)

    def _run(self, worker: int, action: Action, *, end_step: bool) -> None:
        executor = self.executors[worker]
        try:
            with self.meters[worker].action(action):  # the step's end unmetered
                executor.run(action, end_step=False)
            if end_step and action.kind is ActionKind.UPDATE:
                executor.end_step(action.unit)
        except StageAtCut as cut:
            self._cut(worker, cut)
            return
        if action.kind is ActionKind.UPDATE:
            self._after_step(worker, action.unit)

    def _end_step(self, worker: int, step: int, *, evaluate: bool) -> None:
        try:
            self.executors[worker].end_step(step, evaluate=evaluate)
        except StageAtCut as cut:
            self._cut(worker, cut)
            return
        self._after_step(worker, step)

    def _cut(self, worker: int, cut: StageAtCut) -> None:
        self._at_cut.add(worker)
        if len(self._at_cut) == len(self.executors):
            assert self.checkpoint is not None and self._request is not None
            raise RunStopped(
                self.checkpoint.directory, cut.args[0], self._request.signal_name
            ) from None

    def _after_step(self, worker: int, step: int) -> None:
        fault = self._faults[worker]
        if fault is not None:
            fault(step)
        if worker == 0 and self._bar is not None:
            last = self.executors[self.config.require_pipeline().num_stages - 1].runner.losses
            m = self.config.require_pipeline().micro_batch_count
            step_loss = last.get((step + 1) * m - 1)
            self._bar.set_postfix(loss=f"{step_loss:.4f}" if step_loss is not None else "-")
            self._bar.update(1)
