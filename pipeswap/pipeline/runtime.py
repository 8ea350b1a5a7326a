"""One process per stage over torch.distributed: non-blocking transfers, same compute.

The process group is made by :mod:`pipeswap.dist`; this module only sends and receives.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from pipeswap.checkpoint import CheckpointPlan, RunStopped, load_rank
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import (
    backend_name,
    barrier,
    destroy_groups,
    direction_groups,
    gather_to_rank0,
    pair_groups,
    rank_and_world,
    single_threaded,
)
from pipeswap.errors import PipeswapError
from pipeswap.pipeline.config import PipelineConfig, build_full_model, build_meta_model
from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.executor import StageExecutor, StageResult
from pipeswap.pipeline.partition import stage_bounds
from pipeswap.pipeline.result import PipelineResult, combine
from pipeswap.pipeline.schedule import Action
from pipeswap.pipeline.shared import find_shared
from pipeswap.pipeline.snapshot import StageAtCut, StopRequest
from pipeswap.pipeline.stage import BoundarySpec, Packed, inspect_layers
from pipeswap.progress import progress_bar

# Each transfer of a unit is tagged (unit, direction, tensor index): at most this many
# tensors cross one cut.
MAX_TENSORS_PER_CUT = 16


def _tag(kind: str, unit: int, index: int) -> int:
    return (unit * 2 + (kind == "B")) * MAX_TENSORS_PER_CUT + index


class DistTransport:
    """isend/irecv between neighbouring ranks; receives are posted ahead of the compute.

    Sends are never waited for until the end (only polled), so a rank is never blocked
    by a transfer its peer has not yet asked for: the schedule validator's model of a
    non-blocking SEND. Transfers are tagged, and posted in schedule order (what NCCL,
    which ignores tags, relies on). ``groups`` (forward, backward), when given, carries
    each direction's transfers in a process group of its own; see :func:`run_rank`.
    """

    def __init__(
        self,
        rank: int,
        input_spec: BoundarySpec | None,
        output_spec: BoundarySpec | None,
        device: torch.device,
        groups: tuple[Any, Any] | None = None,
    ) -> None:
        self.rank = rank
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.device = device
        self._groups = {"F": groups[0], "B": groups[1]} if groups is not None else {}
        self._posted: dict[tuple[str, int], tuple[Packed, list[Any]]] = {}
        self._sending: list[tuple[Any, torch.Tensor, tuple[str, int]]] = []

    def post(self, kind: str, unit: int) -> None:
        if (kind, unit) in self._posted:
            return
        spec = self.input_spec if kind == "F" else self.output_spec
        if spec is not None and len(spec.tensors) > MAX_TENSORS_PER_CUT:
            raise PipeswapError(
                f"{len(spec.tensors)} tensors cross a cut of stage {self.rank}, more than the "
                f"{MAX_TENSORS_PER_CUT} the runtime tags: cut the model where fewer tensors "
                "pass between layers (--balance)"
            )
        assert spec is not None, f"rank {self.rank} receives no {kind} transfers"
        src = self.rank - 1 if kind == "F" else self.rank + 1
        buffers = spec.empty(self.device, grads=kind == "B")
        group = self._groups.get(kind)
        works = [
            dist.irecv(buf, src=src, tag=_tag(kind, unit, i), group=group)
            for i, buf in enumerate(buffers)
        ]
        self._posted[(kind, unit)] = (buffers, works)

    def take(self, kind: str, unit: int) -> Packed:
        self.post(kind, unit)
        buffers, works = self._posted.pop((kind, unit))
        for work in works:
            work.wait()
        return buffers

    def send(self, kind: str, unit: int, tensors: Packed) -> None:
        dst = self.rank + 1 if kind == "F" else self.rank - 1
        group = self._groups.get(kind)
        for i, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            work = dist.isend(payload, dst=dst, tag=_tag(kind, unit, i), group=group)
            self._sending.append((work, payload, (kind, unit)))

    def progress(self) -> None:
        self._sending = [s for s in self._sending if not s[0].is_completed()]

    def finish(self, abandon: Collection[tuple[str, int]] = ()) -> None:
        """Wait for every send but those in ``abandon`` (saved in a checkpoint instead)."""
        for work, _, key in self._sending:
            if key in abandon:
                continue
            work.wait()
        self._sending = []


class DistExchange:
    """Tied parameters' gradients between holding ranks: isend/irecv in a group per pair.

    ``groups[(src, dst)]`` carries src's gradients to dst only, so each group's stream
    sees one direction in mini-batch order (what NCCL needs); the tag tells the mini-batch,
    group and tensor apart (what gloo needs).
    """

    # At most this many tied tensors per group of holders (the tag packs the index).
    MAX_TENSORS = 64

    def __init__(self, rank: int, groups: dict[tuple[int, int], Any], device: torch.device):
        self.rank = rank
        self.groups = groups
        self.device = device
        self._sending: list[tuple[Any, torch.Tensor, tuple[int, int, int]]] = []

    def _tag(self, group: int, step: int, index: int) -> int:
        return ((step * 1024) + group) * self.MAX_TENSORS + index

    def send(self, group: int, step: int, dst: int, tensors: list[torch.Tensor]) -> None:
        if len(tensors) > self.MAX_TENSORS:
            raise PipeswapError(
                f"{len(tensors)} parameters are tied between the same stages, more than the "
                f"{self.MAX_TENSORS} the runtime tags: tie fewer parameters across stages"
            )
        pg = self.groups[(self.rank, dst)]
        for i, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            work = dist.isend(payload, dst=dst, tag=self._tag(group, step, i), group=pg)
            self._sending.append((work, payload, (group, step, dst)))

    def take(self, group: int, step: int, src: int, like: list[torch.Tensor]) -> list[torch.Tensor]:
        pg = self.groups[(src, self.rank)]
        buffers = [torch.empty_like(t, device=self.device) for t in like]
        works: list[Any] = [
            dist.irecv(buf, src=src, tag=self._tag(group, step, i), group=pg)
            for i, buf in enumerate(buffers)
        ]
        for work in works:
            work.wait()
        self._sending = [s for s in self._sending if not s[0].is_completed()]
        return buffers

    def finish(self, abandon: Collection[tuple[int, int, int]] = ()) -> None:
        """Wait for every send but those in ``abandon`` (saved in a checkpoint instead)."""
        for work, _, key in self._sending:
            if key not in abandon:
                work.wait()
        self._sending = []


def run_rank(
    config: PipelineConfig,
    *,
    device: torch.device | str = "cpu",
    progress: bool = False,
    split_directions: bool | None = None,
    checkpoint: CheckpointPlan | None = None,
    resume: tuple[str, int] | None = None,
) -> PipelineResult | None:
    """Run this rank's stage of ``config`` in the initialized default process group.

    Rank k runs stage k; a one-stage pipeline runs without a process group.
    ``checkpoint`` and ``resume`` are the emulator's (:class:`Emulator`), file for file. Returns the combined result on rank 0 (gathered from every
    rank), None elsewhere. ``split_directions`` (default: with NCCL) sends forward and
    backward transfers through two process groups of their own: NCCL runs one pair's
    sends and receives on one stream in the order they were issued, and a send may wait
    there for its receive, so a receive posted ahead (or a SEND the schedule issues
    before a RECV the peer issues first) could deadlock the pair. One group per
    direction gives each stream one kind of transfer, in unit order on both ends.
    """
    config.check()
    rank, world = rank_and_world()
    if world != config.num_stages:
        raise PipeswapError(
            f"{world} ranks joined a {config.num_stages}-stage pipeline: start one rank per "
            f"stage (--nproc {config.num_stages})"
        )
    device = torch.device(device)
    if device.type == "cuda":
        # NCCL sends, receives and object gathers run on the current device: make it ours.
        torch.cuda.set_device(device)
    if split_directions is None:
        split_directions = backend_name() == "nccl"
    groups = direction_groups(split_directions)
    # Every rank builds the full model: every rank finds the same tied parameters and
    # joins the same pair groups (creating a group is collective).
    holders = {s.holders for s in find_shared(build_meta_model(config), config.balance)}
    pairs = sorted({(a, b) for hs in holders for a in hs for b in hs if a != b})
    tied_groups = pair_groups(pairs)
    threads = single_threaded() if device.type == "cpu" else nullcontext()
    with threads:
        infos = inspect_layers(config)
        schedule = pipeline_schedule(config)
        model = build_full_model(config, device)
        start, stop = stage_bounds(config.balance)[rank]
        transport = DistTransport(
            rank,
            infos[start - 1].output if rank > 0 else None,
            infos[stop - 1].output if rank < world - 1 else None,
            device,
            groups,
        )
        request = None
        if checkpoint is not None:
            request = StopRequest(checkpoint.directory, world, config.steps, decider=rank == 0)
        exchange = DistExchange(rank, tied_groups, device)
        executor = StageExecutor(
            config,
            rank,
            schedule,
            model,
            infos,
            transport,
            device=device,
            checkpoint=checkpoint,
            stop=request,
            exchange=exchange,
        )
        first = 0 if resume is None else executor.restore(load_rank(resume[0], resume[1], rank))
        barrier()
        actions = schedule.actions[rank][first:]
        bar = progress_bar(config.steps, "train (rank 0)", enabled=progress and rank == 0)
        if bar is not None and resume is not None:
            bar.update(resume[1])
        executor.start_clock()
        try:
            _run_actions(executor, transport, actions, bar, fault_hook(rank))
        except StageAtCut as cut:
            # The checkpoint holds the messages that cross the cut; the rest must arrive.
            transport.finish(abandon=executor.crossing_keys)
            exchange.finish(abandon=executor.tied.crossing if executor.tied is not None else ())
            raise RunStopped(checkpoint.directory, cut.args[0]) from None  # type: ignore[union-attr]
        finally:
            if request is not None:
                request.close()
        executor.finish_training()
        if bar is not None:
            bar.close()
        for unit in executor.eval_units():
            executor.evaluate(unit)
        result = executor.finish()
    gathered: list[StageResult] | None = gather_to_rank0(result, rank, world)
    destroy_groups(groups)
    destroy_groups(tuple(tied_groups.values()))
    if rank != 0:
        return None
    assert gathered is not None
    wall = max(r.wall_s for r in gathered)
    return combine(config, gathered, mode="pipeline", task=model.task, wall_s=wall)


def _run_actions(
    executor: StageExecutor,
    transport: DistTransport,
    actions: tuple[Action, ...],
    bar: Any,
    after_step: Callable[[int], None] | None,
) -> None:
    compute = [i for i, a in enumerate(actions) if a.is_compute] + [len(actions)]
    posted_upto = 0
    next_compute = 0
    for i, action in enumerate(actions):
        if action.is_compute:
            # Post the receives of this pass and of the next one, so they arrive while we compute.
            while compute[next_compute] <= i:
                next_compute += 1
            horizon = compute[min(next_compute + 1, len(compute) - 1)]
            for j in range(posted_upto, horizon):
                if actions[j].kind.startswith("RECV"):
                    transport.post(actions[j].kind[-1], actions[j].unit)
            posted_upto = max(posted_upto, horizon)
        executor.run(action)
        if action.kind == "UPDATE":
            if bar is not None:
                bar.update(1)
            if after_step is not None:
                after_step(action.unit)
