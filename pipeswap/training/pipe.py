"""Pipeline(model, stages=K): your own model as a pipeline in your own torchrun script."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import require
from pipeswap.dist.env import local_rank_of
from pipeswap.dist.group import (
    failing_together,
    gather_to_rank0,
    join_as_stages,
    leave_process_group,
    single_threaded,
)
from pipeswap.errors import PipeswapError
from pipeswap.loss_share import weighted_loss
from pipeswap.models.adapt import adapt
from pipeswap.models.base import LayeredModel, evaluating
from pipeswap.models.export import source_module
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.emulator import MailboxTransport
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.feed import FedBatches
from pipeswap.pipeline.horizon import ScheduleHorizon
from pipeswap.pipeline.job import load_stage_tensors
from pipeswap.pipeline.resolve import choose_balance
from pipeswap.pipeline.runtime import StageWires, run_actions
from pipeswap.pipeline.shapes import BatchShapes
from pipeswap.pipeline.shared import find_shared
from pipeswap.pipeline.stage import layer_infos
from pipeswap.precision import DEFAULT_PRECISION, autocast
from pipeswap.schedule.modes import weight_mode
from pipeswap.schedule.partition import stage_bounds
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.training.pipe_checkpoint import Checkpoint, newest_checkpoint, save_stages
from pipeswap.training.pipe_config import pipe_train_config
from pipeswap.training.pipe_optimizer import OptimizerFactory, pipe_optimizer
from pipeswap.training.pipe_padding import given_inputs
from pipeswap.training.pipe_target import ScoredAgainst, check_open_batch, score_batch

__all__ = ["OptimizerFactory", "Pipeline"]


class Pipeline:
    """Your model cut into ``stages`` stages, one per process of your torchrun script.

    ::

        pipe = pipeswap.Pipeline(model, stages=2, schedule="1f1b", micro_batches=4,
                                 optimizer=lambda ps: torch.optim.AdamW(ps))
        for x, y in loader:                  # every rank: the same batches
            loss = pipe.step(x, target=y)    # one mini-batch; the optimizer steps inside
        weights = pipe.state_dict()          # the whole model's, on rank 0
        pipe.close()

    Every rank builds ``model`` the same way (seeded, or ``from_pretrained``; it trains in
    its mode: ``model.train()``) and calls :meth:`step` with the same batches. ``steps``
    (optional) is how many: an unset optimizer then gets the task's warm-up and decay.
    Without it, what an asynchronous schedule has in flight is finished at
    :meth:`state_dict` or :meth:`close`, where training ends, and an unset optimizer's
    rate stays constant (docs/concepts.md). Rank k keeps stage k: its layers (cut at the
    model's repeated blocks by pipeswap.adapt on the first batch; ``balance`` layers per
    stage or the partitioner's), their weight versions (``weights``: the modes of
    ``pipeswap train``) and their ``optimizer`` (an OptimizerConfig, or a function from a
    list of parameters to a torch optimizer). Training is the code ``pipeswap train
    --pipeline`` runs, bit for bit (CPU stages run one intra-op thread each, as there;
    dropout draws from pipeswap's own streams, docs/concepts.md's Randomness: not the
    masks of your loop). Between steps, do nothing that waits for another rank (a
    collective of your own): on an asynchronous schedule a stage may be a step behind.
    ``timeout_s``: how long a rank waits for a silent peer before the run fails.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        stages: int,
        steps: int | None = None,
        schedule: str = PipelineConfig.schedule,
        micro_batches: int | None = None,
        weights: str = PipelineConfig.weights,
        optimizer: OptimizerConfig | OptimizerFactory | None = None,
        balance: tuple[int, ...] | None = None,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None,
        clip_grad_norm: float | None = None,
        precision: str = DEFAULT_PRECISION,
        seed: int = 0,
        device: torch.device | str | None = None,
        blocks: list[str] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        require(
            steps is None or steps >= 1,
            f"steps is {steps}: give the number of pipe.step calls (1 or more), or leave it out",
        )
        self.pipeline = PipelineConfig(
            stages=stages,
            balance=balance,
            schedule=schedule,
            weights=weights,
            micro_batches=micro_batches,
        )
        self.factory, self.optim = pipe_optimizer(optimizer, clip_grad_norm)
        self.steps, self.precision, self.seed = steps, precision, seed
        self.loss_fn = loss_fn
        require(timeout_s > 0, f"timeout_s is {timeout_s}: give seconds, more than 0")
        self.rank, self.world, self._joined = join_as_stages(stages, timeout_s)
        # Without device=: torchrun's LOCAL_RANK names this rank's GPU, if there is one.
        gpu = torch.cuda.is_available()
        own = torch.device("cuda", local_rank_of(self.rank)) if gpu else torch.device("cpu")
        self.device = own if device is None else torch.device(device)
        self.model, self.blocks = model, blocks
        self._layered: LayeredModel | None = None  # adapted on the first batch
        self.done = 0  # pipe.step calls so far (or the checkpoint's steps)
        self._evals = 0
        self._executor: StageExecutor | None = None
        self._horizon: ScheduleHorizon | None = None
        # Why no step may follow: the training ended (the last step, or a drain), or failed.
        self._ended: str | None = None
        self._resume: Checkpoint | None = None
        self._shapes: BatchShapes | None = None
        self._wires: StageWires | None = None
        self._scored: ScoredAgainst | None = None
        self._closed = False  # by pipe.close: nothing may follow

    # ---- training -------------------------------------------------------------------
    @property
    def layered(self) -> LayeredModel:
        """The model as pipeswap cuts it (pipeswap.adapt), from the first batch on."""
        if self._layered is None:
            raise PipeswapError("pipe.layered exists from the first pipe.step or pipe.eval on")
        return self._layered

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage (the one that knows the losses)."""
        return self.rank == self.world - 1

    def step(
        self,
        inputs: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        **other: Any,
    ) -> float | None:
        """Train one mini-batch: ``inputs`` (token ids, images; or as ``input_ids`` /
        ``pixel_values``, so ``pipe.step(**batch)`` takes a collator's batch) and ``target``
        (the next tokens, labels), or ``labels`` as a Hugging Face model takes them (shifted
        here). An ``attention_mask`` is honoured where the pipeline, which runs without one,
        scores the same: right padding of a causal LM, unscored (pipeswap.training.pipe_padding).

        Runs this rank's actions until its first of the next mini-batch, the optimizer's
        update included. Returns the mini-batch's loss on the last stage, None elsewhere.
        """
        require(
            self.steps is None or self.done < self.steps,
            f"pipe.step was called {self.done + 1} times, but this pipeline was built for "
            f"steps={self.steps}: build it with the number of steps you train, or without steps",
        )
        require(self._ended is None, f"pipe.step after {self._ended}")
        inputs = given_inputs(inputs, input_ids, pixel_values, other)
        target = self._scored_by(inputs).choose(inputs, target, labels, attention_mask)
        micro = self.pipeline.micro_batch_count
        executor = self._built(inputs, target, self.done * micro)
        assert self._horizon is not None
        assert executor.train_data is not None or 0 < self.rank < self.world - 1
        if executor.train_data is not None:
            executor.train_data.put(self.done, inputs, target)
        t = self.done
        self._ended = "a pipe.step that failed: build a new pipeline (pipe.load continues a save)"
        with self._threads():
            end = self._horizon.stop_after(t, executor)
            actions = executor.schedule.actions[self.rank][executor.index : end]
            run_actions(executor, executor.transport, actions, None, None)
            if executor.tied is not None and not self.pipeline.asynchronous:
                executor.tied.apply_through(t + 1)  # tied copies hold this step's update too
            last = t + 1 == self.steps
            if last:
                executor.finish_training()
        self._ended = f"the steps={self.steps} it was built for" if last else None
        self.done += 1
        # A loop may run for ever: keep no per-action record, nor the losses handed back.
        executor.result.timeline.clear()
        if not executor.runner.is_last:
            return None
        runner, units = executor.runner, range(t * micro, (t + 1) * micro)
        shares = runner.shares.of_step(t) if runner.shares is not None else None
        return weighted_loss([runner.losses.pop(unit) for unit in units], shares)

    @torch.no_grad()
    def eval(
        self,
        inputs: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        **other: Any,
    ) -> float | None:
        """The loss of a held-out batch on the stages' current weights, without gradients
        and in eval mode (the mean of its micro-batches'); on the last stage, None elsewhere.

        Between steps of a synchronous schedule these are the weights after the last step;
        on an asynchronous one each stage's own newest (a stage may be a step behind).
        """
        inputs = given_inputs(inputs, input_ids, pixel_values, other)
        target = self._scored_by(inputs).choose(inputs, target, labels, attention_mask)
        micro = self.pipeline.micro_batch_count
        executor = self._built(inputs, target, self._evals * micro, eval=True)
        with self._threads():
            assert self._scored is not None
            count = self._scored.item_count()
            loss = score_batch(executor, inputs, target, self._evals, self.device, count)
        self._evals += 1
        return loss

    # ---- weights and checkpoints ----------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights by its own names, on rank 0 (None elsewhere); every
        rank calls it. Rank 0's ``model`` then holds them, and they are its own tensors, as
        ``model.state_dict()``'s are (save or copy them before training on).

        Built without ``steps``, the pipeline first finishes the mini-batches in flight, and
        its training ends: take the weights after the loop."""
        executor = self._require_built("state_dict")
        self._drain("pipe.state_dict")
        named = [*executor.named_parameters(), *executor.module.named_buffers()]
        mine = {name: t.detach().to("cpu", copy=True) for name, t in named}
        states = gather_to_rank0(mine, self.rank, self.world) if self.world > 1 else [mine]
        if states is None:
            return None
        with torch.no_grad():
            load_stage_tensors(self.layered, states)
        state: dict[str, torch.Tensor] = source_module(self.layered).state_dict()
        return state

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write every stage's state after the steps done to ``directory`` (every rank calls
        it); :meth:`load` continues from there, as ``pipeswap train --resume`` does."""
        executor = self._require_built("save")
        self._check_synchronous("save")
        save_stages(executor, directory, self.done, self.world)

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Continue from the newest complete checkpoint :meth:`save` wrote in ``directory``
        (before the first step); returns the steps it had done, which the next
        :meth:`step` continues from (skip that many batches of your loader)."""
        require(self._executor is None, "pipe.load comes before the first pipe.step")
        self._check_synchronous("load")
        self._resume = newest_checkpoint(directory)
        self.done = self._resume.done
        return self.done

    def close(self) -> None:
        """Free the process groups this pipeline made (the default one too when it joined it
        from torchrun's variables; one your script made stays yours), having finished the
        mini-batches in flight without ``steps`` (every rank calls it, unless a step failed)."""
        self._drain("pipe.close")
        self._close_wires()
        if self._joined:
            leave_process_group()
            self._joined = False
        self._closed = True

    # ---- inside -----------------------------------------------------------------------
    def _drain(self, what: str) -> None:
        """End the training of a pipeline built without ``steps``, once: run the actions
        that finish the mini-batches in flight, on the schedule of the steps done."""
        executor, horizon = self._executor, self._horizon
        if self.steps is not None or executor is None or horizon is None or self._ended:
            return
        with self._threads():
            actions = horizon.drain(self.done, executor)
            run_actions(executor, executor.transport, actions, None, None)
            executor.finish_training()
        self._ended = (
            f"{what}, which ended the training of this pipeline built without steps (it "
            "finishes the mini-batches in flight): call it after your loop, or build the "
            "pipeline with steps= to take its weights mid-run"
        )

    def _scored_by(self, inputs: torch.Tensor) -> ScoredAgainst:
        """What the last stage scores against, once the model is adapted: on the first
        batch, which the model runs on to learn how its forward calls its blocks (so a
        model that takes only its own sequence length works as it is)."""
        check_open_batch(inputs, self._closed)
        if self._scored is None:
            self._layered = adapt(self.model, blocks=self.blocks, example=inputs[:1])
            # The defaults of `pipeswap train`: an optimizer left unset is the model's task's.
            fits = weight_mode(self.pipeline.weights).fits
            self.optim = self.optim.filled(self._layered.task, self.steps, fits=fits)
            self._scored = ScoredAgainst(self._layered, self.loss_fn)
        return self._scored

    def _check_synchronous(self, what: str) -> None:
        require(
            not self.pipeline.asynchronous,
            f"pipe.{what}: an asynchronous schedule ({self.pipeline.schedule}) has mini-batches "
            "in flight between steps; checkpoint a synchronous one (gpipe, 1f1b)",
        )

    @property
    def balance(self) -> tuple[int, ...]:
        """Layers per stage (the embeddings and the head count as layers): as given, or as
        the partitioner chose them on the first batch."""
        return self._require_built("balance").pipeline.stage_balance

    def _require_built(self, what: str) -> StageExecutor:
        check_open_batch(None, self._closed, what)
        if self._executor is None:
            raise PipeswapError(f"pipe.{what} comes after the first pipe.step")
        return self._executor

    @contextmanager
    def _threads(self) -> Iterator[None]:
        """Where the stage's actions run: on one thread on a CPU; a failure closes the
        process groups, so the other stages stop at once (pipeswap.dist.group)."""
        threads = single_threaded() if self.device.type == "cpu" else nullcontext()
        with threads, failing_together(self._close_wires):
            yield

    def _close_wires(self) -> None:
        if self._wires is not None:
            self._wires.close()
            self._wires = None

    def _built(
        self, inputs: torch.Tensor, target: torch.Tensor, first_unit: int, eval: bool = False
    ) -> StageExecutor:
        """This stage, built on the first batch; its receives of units ``first_unit`` on
        expected as this batch's shape says (a batch may have any length the model takes)."""
        micro = self.pipeline.micro_batch_count
        require(
            len(inputs) % micro == 0,
            f"a batch of {len(inputs)} does not split into {micro} micro_batches: pass "
            "micro_batches dividing every batch, or batches whose size is a multiple of it",
        )
        if self._executor is None:
            self._executor = self._build(inputs, target)
        if self._wires is not None and self._shapes is not None:
            transport = self._wires.eval_transport if eval else self._wires.transport
            self._shapes.expect(transport, inputs, first_unit)
        return self._executor

    def _build(self, inputs: torch.Tensor, target: torch.Tensor) -> StageExecutor:
        model, rank = self.layered, self.rank
        micro = self.pipeline.micro_batch_count
        batch = int(inputs.shape[0])
        config = pipe_train_config(model, inputs, self)
        where = next((p.device for p in model.parameters()), self.device)
        sample = inputs[: batch // micro].to(where)
        with self._threads(), torch.no_grad(), evaluating(model), autocast(self.precision, where):
            infos = layer_infos(model, sample, model.name)
        config = replace(config, pipeline=choose_balance(config, infos, model.name))
        balance = config.require_pipeline().stage_balance
        first, end = stage_bounds(balance)[rank]
        self._shapes = BatchShapes(
            model, (first, end), rank, self.world, micro, self.precision, inputs
        )
        model.stage(first, end).to(self.device)
        self._horizon = ScheduleHorizon(config, rank, self.steps, self.done)
        config, schedule = self._horizon.config, self._horizon.schedule
        if self.world > 1:
            self._wires = StageWires(infos, balance, find_shared(model, balance), self.device)
            wired: dict[str, Any] = {"transport": self._wires.transport, **self._wires.joins()}
        else:
            wired = {"transport": MailboxTransport(0, {}), "gather_norms": lambda s, m: [m]}
        ends = rank == 0 or rank == self.world - 1
        with self._threads():
            executor = StageExecutor(
                config,
                rank,
                schedule,
                model,
                infos,
                wired.pop("transport"),
                device=self.device,
                data=(FedBatches(micro_batches=micro), None) if ends else None,
                loss_fn=self.loss_fn,
                optimizer_factory=self.factory,
                **wired,
            )
            self._scored_by(inputs).wire(executor)
            if self._resume is not None:
                self._resume.restore(executor, self.world)
        return executor
