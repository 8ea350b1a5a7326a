"""One data-parallel rank with a SwapPlan: DDP over gloo or NCCL, gradient accumulation, offsets.

One process per rank runs :func:`train_rank`; with several ranks the process group must
already be initialised (``pipeswap.dist.run_ranks`` or ``torchrun`` does it). Every rank
trains the same model from the same initial weights on its own slice of the offline
dataset: micro-batch ``(step * sync_every + micro) * world_size + rank``. Gradients are
accumulated over ``sync_every`` micro-batches under ``DistributedDataParallel.no_sync``
and all-reduced with the last one. A rank the plan gives an offset sleeps that long at the
start of every iteration (after its queued GPU work drained): the collectives are the
same on every rank whatever the plan, so a delay can slow the others but never deadlock
them.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipeswap.checkpoint import (
    CheckpointPlan,
    RunStopped,
    StopOnSigterm,
    load_rank,
    rng_state,
    save_rank,
    set_rng_state,
    write_manifest,
)
from pipeswap.dist.digest import combine_digests, params_sha256, tensor_sha256
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import agree, all_gather, rank_device
from pipeswap.errors import PipeswapError
from pipeswap.optim import check_optimizer, make_optimizer
from pipeswap.pipeline.rng import TRAIN, rng_stream
from pipeswap.profile import Profile
from pipeswap.progress import progress_bar
from pipeswap.swap.executor import SwapExecutor
from pipeswap.swap.plan import SwapPlan


class Job(Protocol):
    """What to train; must pickle (it travels to spawned ranks).

    ``seed`` seeds the random streams of training (dropout); a job without one uses 0.
    """

    @property
    def layers(self) -> Sequence[str] | None: ...

    def build(self, device: torch.device) -> nn.Module: ...

    def loss(
        self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor: ...

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class ZooJob:
    """A zoo model trained on its offline dataset (pipeswap.data)."""

    model: str
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    seed: int = 0
    dtype: str = "float32"

    @property
    def layers(self) -> Sequence[str] | None:
        return None  # the zoo model's blocks

    def build(self, device: torch.device) -> nn.Module:
        from pipeswap.models import build_model
        from pipeswap.profiling.step import parse_dtype

        return build_model(
            self.model,
            device=device,
            dtype=parse_dtype(self.dtype),
            image_size=self.image_size,
            seed=self.seed,
        )

    def loss(self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.loss(output, targets)  # type: ignore[operator]

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        dataset = _dataset(self.model, self.seq_len, self.image_size, self.seed)
        inputs, targets = dataset.batch(self.batch_size, index)
        if inputs.is_floating_point():
            from pipeswap.profiling.step import parse_dtype

            inputs = inputs.to(parse_dtype(self.dtype))
        return inputs, targets


@functools.lru_cache(maxsize=8)
def _dataset(model: str, seq_len: int | None, image_size: int | None, seed: int) -> Any:
    from pipeswap.data import dataset_for

    return dataset_for(model, seq_len=seq_len, image_size=image_size, seed=seed)


@dataclass(frozen=True)
class TrainSettings:
    """How to train: steps, gradient accumulation, optimizer, device."""

    steps: int
    sync_every: int = 1
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    device: str = "cpu"  # "cpu" or "cuda" (rank r uses GPU r mod count)
    threads: int | None = None  # CPU threads per rank (default: cores / ranks)
    progress: bool = False  # a tqdm bar on rank 0

    def check(self) -> None:
        if self.steps < 1:
            raise PipeswapError(f"--steps is {self.steps}; train at least 1 step")
        if self.sync_every < 1:
            raise PipeswapError(f"--sync-every is {self.sync_every}; use 1 or more")
        check_optimizer(self.optimizer)
        if self.device not in ("cpu", "cuda"):
            raise PipeswapError(f"unknown device {self.device!r}; use cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise PipeswapError("--device cuda, but PyTorch sees no GPU here; use --device cpu")


@dataclass(frozen=True)
class RankResult:
    """What one rank measured."""

    rank: int
    losses: tuple[float, ...]  # per step: the mean of its micro-batch losses
    step_s: tuple[float, ...]
    params_sha256: str
    peak_resident_bytes: int  # CPU: saved bytes on the device; CUDA: max_memory_allocated
    peak_saved_bytes: int
    budget_bytes: int
    saved_budget_bytes: int
    swapped_bytes: int  # per iteration
    late_fetches: int  # over the whole run
    offset_s: float
    recomputed_layers: int = 0  # layers run forward again in the backward, per iteration
    recomputed_bytes: int = 0  # bytes those re-runs saved, per iteration
    # Buffers (BatchNorm statistics), digested as params_sha256 digests parameters: a
    # recomputed layer's re-run must not update them a second time.
    buffers_sha256: str = ""


def _to(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    # A compact copy, as the profiler measured (a dataset batch may be a strided view).
    if device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.to(device, non_blocking=False).contiguous()


def train_rank(
    job: Job,
    plan: SwapPlan,
    settings: TrainSettings,
    *,
    rank: int = 0,
    world_size: int = 1,
    local_rank: int | None = None,
    profile: Profile | None = None,
    checkpoint: CheckpointPlan | None = None,
    resume: tuple[str, int] | None = None,
) -> RankResult:
    """Train ``job`` on this rank with its part of ``plan``; returns what it measured.

    With ``checkpoint``, every rank writes its state (weights, optimizer, data position,
    RNG) every ``checkpoint.every`` steps, and after the step it is in when SIGTERM
    arrives (the ranks agree on which step), then raises :class:`RunStopped`.
    ``resume`` (directory, steps done) continues from such a checkpoint: the run then
    ends bit-identical to one left alone.
    """
    settings.check()
    threads = settings.threads or max(1, (os.cpu_count() or 1) // world_size)
    if settings.device == "cpu":
        torch.set_num_threads(threads)
    device = rank_device(settings.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        raise PipeswapError("several ranks need a process group: launch with --nproc or torchrun")
    micro = settings.sync_every

    def batch(step: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = job.batch((step * micro + m) * world_size + rank)
        return _to(device, inputs), _to(device, targets)

    model = job.build(device)
    model.train()
    failure: str | None = None
    executor: SwapExecutor | None = None
    try:
        executor = SwapExecutor(
            model, plan, rank=rank, layers=job.layers, profile=profile, device=device
        )
        first_inputs, first_targets = batch(0, 0)
        executor.prepare(lambda: job.loss(model, model(first_inputs), first_targets))
    except PipeswapError as exc:
        failure = str(exc)
    agree(failure, world_size)
    assert executor is not None
    network: nn.Module = model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        network = DistributedDataParallel(
            model, device_ids=ids, bucket_cap_mb=plan.bucket_bytes / 2**20
        )
    optimizer = make_optimizer(
        settings.optimizer,
        model.parameters(),
        lr=settings.lr,
        momentum=settings.momentum,
        weight_decay=settings.weight_decay,
    )
    after_step = fault_hook(rank)
    offset = executor.gpu_plan.offset_s
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses: list[float] = []
    step_s: list[float] = []
    late = 0
    swapped = recomputed_layers = recomputed_bytes = 0
    first = 0
    if resume is not None:
        state = load_rank(resume[0], resume[1], rank)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first, losses, step_s, late = state["done"], state["losses"], state["step_s"], state["late"]
        set_rng_state(state["rng"])
    stop = StopOnSigterm() if checkpoint is not None else None
    bar = progress_bar(
        settings.steps, f"train {plan.policy}", enabled=settings.progress and rank == 0
    )
    if bar is not None:
        bar.update(first)
    for step in range(first, settings.steps):
        started = time.perf_counter()
        if offset > 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            time.sleep(offset)
        micro_losses = []
        swapped = recomputed_layers = recomputed_bytes = 0
        for m in range(micro):
            inputs, targets = batch(step, m)
            last = m == micro - 1
            sync = nullcontext() if world_size == 1 or last else network.no_sync()  # type: ignore[operator]
            # Dropout draws from a stream of (seed, step, micro-batch, rank): a run repeats
            # bit for bit, and swapping or recomputing cannot change a mask (a recomputed
            # layer's re-run, inside the backward below, restarts from the generator
            # states its forward started from).
            with sync, rng_stream(getattr(job, "seed", 0), TRAIN, step, m, rank, device):
                with executor.forward():
                    loss = job.loss(model, network(inputs), targets)
                (loss / micro).backward()
                stats = executor.finish_step()
            late += stats.late_fetches
            swapped += stats.swapped_bytes
            recomputed_layers += stats.recomputed_layers
            recomputed_bytes += stats.recomputed_bytes
            micro_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - started)
        losses.append(sum(micro_losses) / micro)
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update(1)
        if after_step is not None:
            after_step(step)
        if checkpoint is not None and stop is not None:
            stopping = any(all_gather(stop.requested, world_size))
            if stopping or checkpoint.due(step + 1, settings.steps):
                if rank == 0:
                    write_manifest(checkpoint, step + 1)
                save_rank(
                    checkpoint,
                    step + 1,
                    rank,
                    {
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "done": step + 1,
                        "losses": losses,
                        "step_s": step_s,
                        "late": late,
                        "rng": rng_state(),
                    },
                )
            if stopping:
                stop.restore()
                raise RunStopped(checkpoint.directory, step + 1)
    if stop is not None:
        stop.restore()
    if bar is not None:
        bar.close()
    executor.close()
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else executor.peak_saved_bytes
    )
    return RankResult(
        rank=rank,
        losses=tuple(losses),
        step_s=tuple(step_s),
        params_sha256=params_sha256(model),
        peak_resident_bytes=int(peak),
        peak_saved_bytes=executor.peak_saved_bytes,
        budget_bytes=executor.budget_bytes,
        saved_budget_bytes=executor.saved_budget_bytes,
        swapped_bytes=swapped,
        late_fetches=late,
        offset_s=offset,
        recomputed_layers=recomputed_layers,
        recomputed_bytes=recomputed_bytes,
        buffers_sha256=combine_digests(
            {name: tensor_sha256(name, b) for name, b in model.named_buffers()}
        ),
    )


def measured_step_s(results: Sequence[RankResult]) -> float:
    """Median over steps (the first one left out when there are more) of the slowest rank."""
    steps = len(results[0].step_s)
    slowest = [max(r.step_s[s] for r in results) for s in range(steps)]
    return statistics.median(slowest[1:] if steps > 1 else slowest)
