"""One data-parallel rank with a SwapPlan: DDP over gloo or NCCL, gradient accumulation, offsets.

One process per rank runs :func:`train_rank`; with several ranks the process group must
already be initialised (``pipeswap.dist.run_ranks`` or ``torchrun`` does it). Every rank
trains the same model from the same initial weights on its own slice of the offline
dataset: micro-batch ``(step * accumulate + micro) * world_size + rank``. Gradients are
accumulated over ``accumulate`` micro-batches without an all-reduce (``pipeswap.dist.ddp.accumulating``)
and all-reduced with the last one. A rank the plan gives an offset sleeps that long at the
start of every iteration (after its queued GPU work drained): the collectives are the
same on every rank whatever the plan, so a delay can slow the others but never deadlock
them.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import torch

from pipeswap.checkpoint import (
    CheckpointPlan,
    StopOnSigterm,
    load_rank,
    rng_state,
    save_rank,
    set_rng_state,
    write_manifest,
)
from pipeswap.dist.ddp import accumulating, replicate
from pipeswap.dist.digest import combine_digests, params_sha256, tensor_sha256
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import agree, all_gather, rank_and_world, rank_device
from pipeswap.dist.threads import rank_threads
from pipeswap.errors import PipeswapError
from pipeswap.loss_share import Share, shares_from, weighted_loss
from pipeswap.metrics import HeldOutSums, StepLog
from pipeswap.models.base import evaluating
from pipeswap.models.export import export_trained
from pipeswap.models.tasks import scores_accuracy
from pipeswap.pipeline.rng import TRAIN, rng_stream
from pipeswap.precision import LossScaler, autocast
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.profiling.profile import Profile
from pipeswap.progress import progress_bar
from pipeswap.swap.plan import SwapPlan
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.train_config import TrainConfig
from pipeswap.training.dp_result import RankRecord, RankResult
from pipeswap.training.job import Job

__all__ = ["train_rank"]


def _to(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    # A compact copy, as the profiler measured (a dataset batch may be a strided view).
    if device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device, non_blocking=False).contiguous()


class _Rank:
    """One rank's model, executor, replica and optimizer, and the steps that train them."""

    def __init__(
        self,
        job: Job,
        plan: SwapPlan,
        config: TrainConfig,
        *,
        rank: int,
        world_size: int,
        local_rank: int | None,
        profile: Profile | None,
        threads: int | None,
    ) -> None:
        self.job, self.config, self.rank, self.world_size = job, config, rank, world_size
        assert config.device is not None, "a resolved config names its device"
        if config.device == "cpu":
            torch.set_num_threads(threads or rank_threads(world_size))
        self.device = rank_device(config.device, rank if local_rank is None else local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if world_size > 1 and rank_and_world()[1] != world_size:
            raise PipeswapError(
                "several ranks need a process group: launch them with pipeswap.dist"
            )
        self.micro = config.optim.accumulate
        self.model = job.build(self.device)
        self.model.train()
        self.executor = self._executor(plan, profile)
        self.network = replicate(self.model, self.device, plan.bucket_bytes, world_size)
        self.optimizer = config.optim.build(self.model.parameters())
        self.scaler = LossScaler(config.precision, self.device)
        self.record = RankRecord()
        self.measured_peak_bytes = -1  # the meter's reading of the first steps, once run
        self._metered_steps = 0

    def loss(
        self, module: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """The loss of a micro-batch through ``module`` (the model or its replica), the
        forward in the run's precision."""
        with autocast(self.config.precision, self.device):
            return self.job.loss(self.model, module(inputs), targets)

    def _executor(self, plan: SwapPlan, profile: Profile | None) -> SwapExecutor:
        """The plan's executor, prepared on the first batch; every rank fails if one does."""
        failure: PipeswapError | None = None
        executor: SwapExecutor | None = None
        try:
            executor = SwapExecutor(
                self.model,
                plan,
                rank=self.rank,
                layers=self.job.layers,
                profile=profile,
                device=self.device,
            )
            inputs, targets = self.batch(0, 0)
            executor.prepare(lambda: self.loss(self.model, inputs, targets))
        except PipeswapError as exc:
            failure = exc
            if executor is not None:
                executor.close()
        agree(failure, self.world_size)
        assert executor is not None
        return executor

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of micro-batch ``micro`` of ``step``."""
        index = (step * self.micro + micro) * self.world_size + self.rank
        inputs, targets = self.job.batch(index)
        return _to(self.device, inputs), _to(self.device, targets)

    def resume(self, directory: str, done: int) -> None:
        state = load_rank(directory, done, self.rank)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state.get("scaler", {}))
        self.record = RankRecord(state["done"], state["losses"], state["step_s"], state["late"])
        self.record.evals = [tuple(e) for e in state.get("evals", [])]
        set_rng_state(state["rng"])

    def step(self, step: int) -> None:
        """One optimizer step: ``accumulate`` micro-batches, gradients all-reduced with the last.

        The device's meter reads the run's first two steps (the second holds the optimizer
        state the first makes): CUDA's allocator, or the live storages less the host pool."""
        if self._metered_steps >= 2:
            return self._step(step)
        self._metered_steps += 1
        exclude = (self.executor.pool.buffer,)
        with DeviceMeter(
            self.device, holding=(self.model, self.optimizer), exclude=exclude
        ) as meter:
            self._step(step)
        self.measured_peak_bytes = max(self.measured_peak_bytes, meter.peak)

    def _step(self, step: int) -> None:
        started = time.perf_counter()
        offset = self.executor.gpu_plan.offset_s
        if offset > 0:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            time.sleep(offset)
        record = self.record
        record.swapped = record.recomputed_layers = record.recomputed_bytes = 0
        losses = []
        shares = self._shares(step)
        for m in range(self.micro):
            inputs, targets = self.batch(step, m)
            share = shares[m] if shares is not None else None
            # Dropout draws from a stream of (seed, step, micro-batch, rank): a run repeats
            # bit for bit, and swapping or recomputing cannot change a mask (a recomputed
            # layer's re-run, inside the backward below, restarts from the generator
            # states its forward started from).
            stream = rng_stream(
                getattr(self.job, "seed", 0), TRAIN, step, m, self.rank, self.device
            )
            with accumulating(self.network, sync=m == self.micro - 1), stream:
                with self.executor.forward():
                    loss = self.loss(self.network, inputs, targets)
                scaled = loss / self.micro if share is None else share.scaled(loss)
                self.scaler.scale(scaled).backward()
                stats = self.executor.finish_step()
            record.late += stats.late_fetches
            record.swapped += stats.swapped_bytes
            record.recomputed_layers += stats.recomputed_layers
            record.recomputed_bytes += stats.recomputed_bytes
            losses.append(loss.item() if share is None or share.items else 0.0)
            self.config.optim.check_loss(losses[-1], step, model=self.model, inputs=inputs)
        if self.config.optim.lr_varies:
            for group in self.optimizer.param_groups:
                group["lr"] = self.config.optim.lr_at(step)
        self.scaler.unscale(self.optimizer)
        if self.config.optim.clip_grad_norm is not None:
            # After the all-reduce: every rank scales the same averaged gradients alike.
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.config.optim.clip_grad_norm, foreach=False)
        self.scaler.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        record.step_s.append(time.perf_counter() - started)
        record.losses.append(weighted_loss(losses, shares))
        record.done = step + 1

    def _shares(self, step: int) -> list[Share] | None:
        """Each micro-batch's share of the items the step scores on every rank, where they
        differ (a user's pairs, -100 on their prompts and padding): the gradient is then the
        whole batch's token mean, as one loss over it gives (pipeswap.loss_share)."""
        count = getattr(self.job, "scored_items", None)
        if count is None:
            return None
        first = step * self.micro * self.world_size + self.rank
        mine = [count(self.job.batch(first + m * self.world_size)[1]) for m in range(self.micro)]
        total = sum(all_gather(sum(mine), self.world_size))
        return shares_from(mine, total, self.world_size)

    def save(self, checkpoint: CheckpointPlan) -> None:
        """Write this rank's state after the step just done (rank 0 names the set first)."""
        record = self.record
        if self.rank == 0:
            write_manifest(checkpoint, record.done)
        save_rank(
            checkpoint,
            record.done,
            self.rank,
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "done": record.done,
                "losses": record.losses,
                "step_s": record.step_s,
                "late": record.late,
                "evals": record.evals,
                "rng": rng_state(),
            },
        )

    def mean_loss(self) -> float:
        """The last step's loss, the mean over the ranks' (every rank calls it)."""
        losses = all_gather(self.record.losses[-1], self.world_size)
        return float(sum(losses) / len(losses))

    def at_boundary(
        self, step: int, caught: str | None, checkpoint: CheckpointPlan | None
    ) -> str | None:
        """After ``step``: the signal that stops the run here, as every rank agrees (None:
        go on; a signal in the last step lets it end), having checkpointed when due."""
        signals = [s for s in all_gather(caught, self.world_size) if s is not None]
        if checkpoint is not None and (signals or checkpoint.due(step + 1, self.config.steps)):
            self.save(checkpoint)
        return signals[0] if signals and step + 1 < self.config.steps else None

    def evaluate(self) -> HeldOutSums:
        """Score ``eval_batches`` held-out batches in eval mode (ranks take disjoint ones)."""
        batches = self.config.dataset.eval_batches
        loss_sum, correct, samples = 0.0, 0, 0
        accuracy = scores_accuracy(self.model)
        with evaluating(self.model):
            for i in range(batches):
                inputs, targets = self.job.batch(i * self.world_size + self.rank, "val")
                inputs, targets = _to(self.device, inputs), _to(self.device, targets)
                with autocast(self.config.precision, self.device):
                    output = self.model(inputs)
                    loss_sum += self.job.loss(self.model, output, targets).item()
                if accuracy:
                    correct += int((output.argmax(-1) == targets).sum().item())
                samples += int(targets.shape[0])
        return HeldOutSums(batches, loss_sum, correct, samples)

    def score_every_rank(self, step: int) -> dict[str, float | int]:
        """The held-out score over every rank's batches after ``step`` (collective)."""
        parts = all_gather(self.evaluate(), self.world_size)
        total = HeldOutSums.total(parts)
        score = total.score(total.batches, classify=scores_accuracy(self.model))
        self.record.evals.append((step + 1, score))
        return score

    def result(self) -> RankResult:
        executor, record, device = self.executor, self.record, self.device
        peak = self.measured_peak_bytes
        if device.type == "cuda" and peak >= 0:
            peak = max(peak, torch.cuda.max_memory_allocated(device))
        return RankResult(
            rank=self.rank,
            losses=tuple(record.losses),
            step_s=tuple(record.step_s),
            params_sha256=params_sha256(self.model),
            peak_resident_bytes=int(peak),
            peak_saved_bytes=executor.peak_saved_bytes,
            budget_bytes=executor.budget_bytes,
            saved_budget_bytes=executor.saved_budget_bytes,
            swapped_bytes=record.swapped,
            late_fetches=record.late,
            offset_s=executor.gpu_plan.offset_s,
            recomputed_layers=record.recomputed_layers,
            recomputed_bytes=record.recomputed_bytes,
            evals=tuple(record.evals),
            buffers_sha256=combine_digests(
                {name: tensor_sha256(name, b) for name, b in self.model.named_buffers()}
            ),
        )


def train_rank(
    job: Job,
    plan: SwapPlan,
    config: TrainConfig,
    *,
    rank: int = 0,
    world_size: int = 1,
    local_rank: int | None = None,
    profile: Profile | None = None,
    checkpoint: CheckpointPlan | None = None,
    resume: tuple[str, int] | None = None,
    threads: int | None = None,
    log: StepLog | None = None,
) -> RankResult:
    """Train ``job`` on this rank with its part of ``plan`` for ``config.steps`` steps.

    ``config`` (resolved) gives the steps, ``accumulate``, the optimizer and the device;
    ``threads`` the CPU threads of this rank (default: its share of what this process may
    use, pipeswap.dist.threads). SIGTERM or SIGINT stops the run after the step it is in
    (the ranks agree on which): the result holds the steps done and names the signal
    (``stopped_by``; no held-out score, no saved model). With ``checkpoint``, every rank
    writes its state (weights, optimizer, data position, RNG) every ``checkpoint.every``
    steps, after the last, and after the step a signal stopped. ``resume`` (directory,
    steps done) continues from such a checkpoint: the run then ends bit-identical to one
    left alone. ``log`` records each step (rank 0's).
    """
    trainer = _Rank(
        job,
        plan,
        config,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        profile=profile,
        threads=threads,
    )
    with trainer.executor:
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        if resume is not None:
            trainer.resume(*resume)
        after_step = fault_hook(rank)
        stop = StopOnSigterm((signal.SIGTERM, signal.SIGINT))
        stopped_by: str | None = None
        show = config.progress and rank == 0
        bar = progress_bar(config.steps, f"train {plan.policy}", enabled=show)
        try:
            if bar is not None:
                bar.update(trainer.record.done)
            for step in range(trainer.record.done, config.steps):
                trainer.step(step)
                loss = trainer.mean_loss()  # every rank's, as the summary states it
                if log is not None:
                    log.step(step, loss, config.optim.lr_at(step), trainer.record.step_s[-1])
                if bar is not None:
                    bar.set_postfix(loss=f"{loss:.4f}")
                    bar.update(1)
                if config.dataset.eval_due(step, config.steps):
                    score = trainer.score_every_rank(step)
                    if log is not None:
                        log.eval(step, score)
                if after_step is not None:
                    after_step(step)
                stopped_by = trainer.at_boundary(step, stop.caught, checkpoint)
                if stopped_by is not None:
                    break
        finally:
            stop.restore()
            if bar is not None:
                bar.close()
        result = trainer.result()
    if stopped_by is not None:
        return replace(result, stopped_by=stopped_by)
    # After the executor let go of the model: evaluation saves nothing to swap.
    result = replace(result, held_out=trainer.evaluate())
    if rank == 0:
        export_trained(trainer.model, config.checkpoint, source=config.model, steps=config.steps)
    return result
