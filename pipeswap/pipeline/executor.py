"""Run one stage's actions: the same code drives the emulator and the distributed runtime."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from pipeswap.checkpoint import CheckpointPlan, rng_state, save_rank, write_manifest
from pipeswap.dist.digest import combine_digests, tensor_sha256
from pipeswap.metrics import StepLog
from pipeswap.models.tasks import scores_accuracy
from pipeswap.pipeline.held_out import HeldOutScorer
from pipeswap.pipeline.job import BatchSource
from pipeswap.pipeline.predict import delay_lr_scale, steady_distances, version_distances
from pipeswap.pipeline.replica_average import Averaging
from pipeswap.pipeline.rng import TRAIN, rng_stream
from pipeswap.pipeline.shared import Exchange, TiedParameters, find_shared, stage_module
from pipeswap.pipeline.snapshot import StageAtCut, StopRequest
from pipeswap.pipeline.stage import BoundarySpec, LayerInfo, Packed, StageRunner
from pipeswap.pipeline.stage_cuts import StageCuts
from pipeswap.pipeline.stage_memory import MemoryFactory
from pipeswap.pipeline.stage_result import StageResult
from pipeswap.pipeline.step_end import clip_scale, step_loss
from pipeswap.pipeline.weights import StageWeights
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.timetable import Schedule, TimedAction
from pipeswap.train_config import TrainConfig

__all__ = ["StageExecutor", "Transport"]


class Transport(Protocol):
    """Moves packed activations (``direction`` ActionKind.F) and gradients (ActionKind.B,
    :attr:`ActionKind.direction`) of a unit between stages."""

    def post(self, direction: ActionKind, unit: int) -> None: ...
    def take(self, direction: ActionKind, unit: int) -> Packed: ...
    def send(self, direction: ActionKind, unit: int, tensors: Packed) -> None: ...
    def progress(self) -> None: ...
    def finish(self) -> None: ...


class StageExecutor:
    """One stage: its layers (``runner``), its weight versions, its data, and a transport.

    Every forward of a unit runs under the RNG stream of (seed, mini-batch, micro-batch,
    stage) (:mod:`pipeswap.pipeline.rng`): dropout draws the same masks in the emulator
    and in every process. Parameters tied across stages get a copy per stage, kept equal
    through ``exchange`` (:mod:`pipeswap.pipeline.shared`).

    At an UPDATE the stages may meet (pipeswap.pipeline.step_end): ``gather_norms`` gives
    every stage's squared gradient norm (the emulator presets ``norm_parts``), held-out
    batches go through ``eval_transport``; the last stage logs each step to ``log``.
    ``data`` (sources with ``micro(step, m)``), ``loss_fn`` and ``optimizer_factory``
    replace the config's batches, the model's loss and optimizer (pipeswap.Pipeline's).
    Replica ``replica`` of a replicated pipeline (``PipelineConfig.replicas``) reads its own
    batches and averages each mini-batch's gradients over the replicas with ``average``
    (pipeswap.pipeline.replica_average.Averaging) around the backward that completes them.
    """

    def __init__(
        self,
        config: TrainConfig,
        stage: int,
        schedule: Schedule,
        model: torch.nn.Module,
        infos: list[LayerInfo],
        transport: Transport,
        *,
        record: bool = False,
        keep_gradients: bool = False,
        device: torch.device | str = "cpu",
        checkpoint: CheckpointPlan | None = None,
        stop: StopRequest | None = None,
        exchange: Exchange | None = None,
        gather_norms: Callable[[int, float], list[float]] | None = None,
        eval_transport: Transport | None = None,
        log: StepLog | None = None,
        data: tuple[Any, Any] | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        optimizer_factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
        | None = None,
        replica: int = 0,
        average: Averaging | None = None,
        memory: MemoryFactory | None = None,
    ) -> None:
        self.config = config
        self.replica = replica
        self.average = average
        self._deferred: int | None = None
        self.pipeline = pipeline = config.require_pipeline()
        self.micro_batches = pipeline.micro_batch_count
        self.stage = stage
        # This stage's place among every replica's (its global rank in processes): names
        # its checkpoint file and its random stream.
        self.worker = replica * pipeline.num_stages + stage
        self.schedule = schedule
        self.transport = transport
        self.eval_transport = eval_transport or transport
        self.gather_norms = gather_norms
        self.norm_parts: dict[int, list[float]] = {}
        self.log = log
        self.device = torch.device(device)
        first, end = stage_bounds(pipeline.stage_balance)[stage]
        n = pipeline.num_stages
        input_spec: BoundarySpec | None = infos[first - 1].output if stage > 0 else None
        output_spec: BoundarySpec | None = infos[end - 1].output if stage < n - 1 else None
        shared = find_shared(model, pipeline.stage_balance)
        self.module, copies = stage_module(model, first, end, shared)
        # Digests name a tied copy as the whole model does, so they combine to its digest.
        self._canonical = {id(p): name for name, p in copies.items()}
        self.runner = StageRunner(
            stage,
            n,
            self.module,
            loss_fn or model.loss,  # type: ignore[arg-type]
            micro_batches=self.micro_batches,
            input_spec=input_spec,
            output_spec=output_spec,
            precision=config.precision,
            device=self.device,
        )
        # What keeps the saved tensors of the units in flight within a budget (swapping).
        self.memory = memory(stage, self.module) if memory is not None else None
        units = range(schedule.num_units)
        self.weights = StageWeights(
            self.module,
            pipeline.weights,
            version_distances(schedule, stage, pipeline.distances),
            {u: schedule.step_of(u) for u in units},
            optimizer_config=config.optim,
            record=record,
            keep_gradients=keep_gradients,
            shared=copies,
            originals={n: p for n, p in model.named_parameters() if n in copies},
            optimizer_factory=optimizer_factory,
            lr_scale=delay_lr_scale(schedule, stage, pipeline.delay_power(config.optim.name)),
            guard_spikes=pipeline.stability_rule,
        )
        self.tied: TiedParameters | None = None
        if copies:
            assert exchange is not None, "a stage holding tied parameters needs an exchange"
            mine = [s for s in shared if stage in s.holders]
            self.tied = TiedParameters(stage, schedule, mine, self.weights, exchange)
        # Batches: ``data`` (training, held-out sources with ``micro``), else the config's.
        if data is None and (stage == 0 or stage == n - 1):
            data = (
                BatchSource(config, model, "train", replica),  # type: ignore[arg-type]
                BatchSource(config, model, "val"),  # type: ignore[arg-type]
            )
        self.train_data: Any = (data or (None, None))[0]
        self.eval_data: Any = (data or (None, None))[1]
        self.result = StageResult(
            stage, distances=steady_distances(schedule, stage, pipeline.distances)
        )
        self.scorer = HeldOutScorer(
            config,
            self.runner,
            self.result,
            self._eval_inputs,
            self.stream,
            self.eval_transport,
            num_units=schedule.num_units,
            classify=scores_accuracy(model),
            log=log,
        )
        self._outbox: dict[tuple[ActionKind, int], Packed] = {}
        self._t0 = self._step_ended = time.perf_counter()
        self.index = 0  # of this stage's next action (a resume sets it)
        self.checkpoint = checkpoint
        self.stop = stop
        self.cuts = StageCuts(checkpoint, schedule, stage, config.steps)

    # ---- training -----------------------------------------------------------------
    def start_clock(self) -> None:
        self._t0 = self._step_ended = time.perf_counter()

    def run(self, action: Action, *, end_step: bool = True) -> None:
        """Execute one action of this stage (in schedule order); after an UPDATE, what ends
        the step (:meth:`end_step`) unless ``end_step`` is False (the caller does it)."""
        kind, unit = action.kind, action.unit
        if kind.is_receive:
            self.transport.post(kind.direction, unit)
        elif kind.is_send:
            message = self._outbox.pop((kind.direction, unit))
            self.cuts.sent(kind.direction, unit, message)
            self.transport.send(kind.direction, unit, message)
        else:
            start = time.perf_counter()
            if kind.is_pass and self.tied is not None:
                self.tied.before_pass(self.index)
            if kind is ActionKind.F:
                self._forward(unit)
            elif kind is ActionKind.B:
                step, micro = divmod(unit, self.micro_batches)
                # The mini-batch's gradient is complete after its last micro-batch's backward.
                average = self.average if micro == self.micro_batches - 1 else None
                if average is not None:
                    average.start(step, self)
                self._backward(unit)
                if average is None or average(step, self):
                    self.after_average()
                else:
                    self._deferred = self.index
            else:
                self._update(unit)
            if self.memory is not None:
                self.memory.after_action(self.index)
            end = time.perf_counter()
            self.result.busy_s += end - start
            self.result.timeline.append(
                TimedAction(self.stage, self.index, action, start - self._t0, end - self._t0)
            )
        self.index += 1
        self.transport.progress()
        if kind is ActionKind.UPDATE and end_step:
            self.end_step(unit)

    def after_average(self) -> None:
        """The rest of a backward once its gradients are final: tied parameters' gradients
        leave for their other holders."""
        index = self.index if self._deferred is None else self._deferred
        self._deferred = None
        if self.tied is not None:
            self.tied.after_backward(index)

    def gradient_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.weights.params if p.requires_grad]

    def gradients(self) -> list[torch.Tensor]:
        """This stage's gradients as they stand (its parameters' that have one), in order."""
        return [p.grad for p in self.weights.params if p.grad is not None]

    def squared_norm(self, step: int) -> float:
        """This stage's share of the squared global norm of mini-batch ``step``'s gradient."""
        tied = self.tied.squared_norm(step) if self.tied is not None else 0.0
        return self.weights.own_squared_norm() + tied

    def _update(self, step: int) -> None:
        max_norm = self.config.optim.clip_grad_norm
        if max_norm is not None:
            parts = self.norm_parts.pop(step, None)
            if parts is None:
                assert self.gather_norms is not None, "clipping needs every stage's norm"
                parts = self.gather_norms(step, self.squared_norm(step))
            self.weights.clip_scales[step] = clip_scale(parts, max_norm)
        self.weights.update(step)
        if self.tied is not None:
            self.tied.release(step + 1)

    def end_step(self, step: int, *, evaluate: bool = True) -> None:
        """After UPDATE(``step``): score the held-out batches when due (``evaluate``; the
        emulator does it for every stage at once), log the step, write a checkpoint when
        due, and stop at a SIGTERM cut."""
        if self.log is not None:
            loss = step_loss(self.runner.losses, step, self.micro_batches)
            took = time.perf_counter() - self._step_ended
            self.log.step(step, loss, self.config.optim.lr_at(step), took)
        if evaluate:
            self.scorer.score_if_due(step)
        if self.log is not None and self.result.evals and self.result.evals[-1][0] == step + 1:
            self.log.eval(step, self.result.evals[-1][1])
        self._step_ended = time.perf_counter()
        if self.checkpoint is not None:
            done = step + 1
            cut = self.stop.cut_after(self.worker, done) if self.stop is not None else None
            if done == cut or self.checkpoint.due(done, self.config.steps):
                self.save(self.checkpoint, done)
            if done == cut:
                raise StageAtCut(done)
            if cut is not None:  # keep what will cross the SIGTERM cut, too
                self.cuts.keep_for_cut(cut)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.device)

    def _inputs(
        self,
        source: BatchSource | None,
        step: int,
        micro: int,
        unit: int,
        transport: Transport | None = None,
    ) -> tuple[Any, torch.Tensor | None]:
        """A unit's input (data on stage 0, received activations after) and its target."""
        inputs: Any = None
        target = None
        if source is not None:
            x, y = source.micro(step, micro)
            inputs, target = self.to_device(x), self.to_device(y)
        if self.stage > 0:
            inputs = (transport or self.transport).take(ActionKind.F, unit)
        return inputs, target

    def stream(self, split: str, step: int, micro: int) -> AbstractContextManager[None]:
        """The RNG stream of this stage's forward of (step, micro) (pipeswap.pipeline.rng)."""
        return rng_stream(self.config.seed, split, step, micro, self.worker, self.device)

    def _forward(self, unit: int) -> None:
        step, micro = divmod(unit, self.micro_batches)
        inputs, target = self._inputs(self.train_data, step, micro, unit)
        self.weights.before(ActionKind.F, unit)
        self.cuts.forward(unit, self.weights.params)
        target = target if self.runner.is_last else None
        memory = self.memory
        keep = memory.forward(unit, self.runner.trial(inputs, target)) if memory else nullcontext()
        with self.stream(TRAIN, step, micro), keep:
            out = self.runner.forward(unit, inputs, target)
            if memory is not None:  # what the runner holds anyway is not worth a copy
                memory.keep(self.runner.held(unit))
        if self.runner.is_last:
            self.config.optim.check_loss(
                self.runner.losses[unit], step, model=self.runner.module, inputs=inputs
            )
        self.weights.after(ActionKind.F, unit)
        if out is not None:
            self._outbox[(ActionKind.F, unit)] = out

    def _backward(self, unit: int) -> None:
        grads = None if self.runner.is_last else self.transport.take(ActionKind.B, unit)
        self.cuts.forward_weights.pop(unit, None)
        self.weights.before(ActionKind.B, unit)
        out = self.runner.backward(unit, grads)
        if self.memory is not None:
            self.memory.after_backward(unit)
        self.weights.after(ActionKind.B, unit)
        if out is not None:
            self._outbox[(ActionKind.B, unit)] = out

    def finish_training(self) -> None:
        if self.tied is not None:
            # Tied updates no pass was left to wait for: apply them after the last action.
            self.tied.before_pass(len(self.schedule.actions[self.stage]))
            self.tied.exchange.finish()
        self.transport.finish()
        self.result.wall_s = time.perf_counter() - self._t0
        self.result.losses = dict(self.runner.losses)
        record = self.weights.record
        self.result.prediction_error = self.weights.prediction_error() if record else None

    # ---- evaluation ---------------------------------------------------------------
    def _eval_inputs(self, step: int, micro: int, unit: int) -> tuple[Any, torch.Tensor | None]:
        return self._inputs(self.eval_data, step, micro, unit, self.eval_transport)

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, plan: CheckpointPlan, done: int) -> None:
        """Write this stage's state at its cut after ``done`` steps (pipeline.snapshot);
        pipeswap.pipeline.stage_restore continues from it."""
        assert not self._outbox
        if self.worker == 0:
            write_manifest(plan, done)
        state = {
            "done": done,
            "index": self.index,
            "weights": self.weights.state(),
            "losses": dict(self.runner.losses),
            "evals": list(self.result.evals),
            "in_flight": {
                unit: (self.cuts.forward_weights[unit], leaves)
                for unit, leaves in self.runner.in_flight_inputs().items()
            },
            "sent": self.cuts.kept,
            "rng": rng_state(),
            "tied": self.tied.state(done) if self.tied is not None else {},
            # What `pipeswap export` reads: the weights' names in the whole model.
            "names": [name for name, _ in self.named_parameters()],
            "buffers": {n: b.detach().clone() for n, b in self.module.named_buffers()},
        }
        save_rank(plan, done, self.worker, state)
        self.cuts.saved(done)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """This stage's parameters by their names in the whole model (a tied copy's too)."""
        return [
            (self._canonical.get(id(p), local), p) for local, p in self.module.named_parameters()
        ]

    def finish(self) -> StageResult:
        self.transport.finish()
        self.eval_transport.finish()
        self.result.held_out = self.scorer.scored
        self.result.param_digests = {
            name: tensor_sha256(name, p) for name, p in self.named_parameters()
        }
        self.result.sha256 = combine_digests(self.result.param_digests)
        if self.memory is not None:
            self.result.memory = self.memory.stats()
            self.memory.close()
        if self.config.checkpoint.save is not None:
            named = [*self.named_parameters(), *self.module.named_buffers()]
            self.result.state = {name: t.detach().to("cpu", copy=True) for name, t in named}
        return self.result
