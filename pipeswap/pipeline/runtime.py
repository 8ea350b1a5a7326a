"""One process per stage: the emulator's compute, with transfers between processes.

The process groups and the transfers themselves belong to :mod:`pipeswap.dist`
(:mod:`pipeswap.dist.p2p`); this module says which buffers go where, under which tags, when.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import nullcontext
from typing import Any

import torch

from pipeswap.checkpoint import CheckpointPlan, RunStopped, load_rank
from pipeswap.config_fields import ConfigError, require
from pipeswap.dist.faults import fault_hook
from pipeswap.dist.group import (
    all_gather,
    backend_name,
    barrier,
    destroy_groups,
    direction_groups,
    gather_to_rank0,
    new_groups,
    pair_groups,
    rank_and_world,
    single_threaded,
)
from pipeswap.dist.p2p import Receive, Sends, pack_tag, post_receives
from pipeswap.dist.replica_groups import ReplicaMesh
from pipeswap.metrics import StepLog
from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.exchange import DistExchange
from pipeswap.pipeline.executor import StageExecutor, Transport
from pipeswap.pipeline.job import build_full_model, build_meta_model, save_trained
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.result import PipelineResult, combine
from pipeswap.pipeline.shared import SharedParam, find_shared
from pipeswap.pipeline.snapshot import StageAtCut, StopRequest
from pipeswap.pipeline.stage import BoundarySpec, LayerInfo, Packed, inspect_layers
from pipeswap.pipeline.stage_memory import MemoryFactory
from pipeswap.pipeline.stage_meter import StageMeter, metered_steps
from pipeswap.pipeline.stage_restore import restore_stage
from pipeswap.pipeline.stage_result import StageResult
from pipeswap.progress import progress_bar
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.partition import stage_bounds
from pipeswap.train_config import TrainConfig

__all__ = ["MAX_TENSORS_PER_CUT", "DistTransport", "StageWires", "run_actions", "run_stage_rank"]

# Each transfer of a unit is tagged (unit, direction, tensor index): at most this many
# tensors cross one cut.
MAX_TENSORS_PER_CUT = 16


def _tag(direction: ActionKind, unit: int, index: int) -> int:
    return pack_tag(unit, (int(direction == ActionKind.B), 2), (index, MAX_TENSORS_PER_CUT))


class DistTransport:
    """Transfers between neighbouring stages (pipeswap.dist.p2p); receives posted ahead.

    A send is waited for only once its peer is known to have it (a unit's activations
    when its gradient comes back; every send of a synchronous step at its end), so a rank
    is never blocked by a transfer its peer has not asked for yet, and gloo (whose sends
    say they are done only when waited for) frees them. Transfers are tagged and posted
    in schedule order (what NCCL, which ignores tags, relies on); ``groups`` (forward,
    backward) carries each direction in a process group of its own."""

    def __init__(
        self,
        stage: int,
        input_spec: BoundarySpec | None,
        output_spec: BoundarySpec | None,
        device: torch.device,
        groups: tuple[Any, Any] | None = None,
        base: int = 0,
    ) -> None:
        self.stage = stage
        self.base = base  # the global rank of this replica's stage 0
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.device = device
        self._groups = (
            {ActionKind.F: groups[0], ActionKind.B: groups[1]} if groups is not None else {}
        )
        self._posted: dict[tuple[ActionKind, int], Receive] = {}
        self._sends: Sends[tuple[ActionKind, int]] = Sends()
        self._expected: dict[tuple[ActionKind, int], BoundarySpec | None] = {}

    def expect(self, direction: ActionKind, unit: int, spec: BoundarySpec | None) -> None:
        """Receive ``unit``'s transfer in ``direction`` as ``spec`` says rather than as the
        stage's own specs do (a batch of another shape, pipeswap.Pipeline)."""
        self._expected[(direction, unit)] = spec

    def post(self, direction: ActionKind, unit: int) -> None:
        if (direction, unit) in self._posted:
            return
        # Activations come from the previous stage, gradients from the next.
        own = self.input_spec if direction is ActionKind.F else self.output_spec
        spec = self._expected.pop((direction, unit), own)
        if spec is not None:
            self._check_count(len(spec.tensors))
        assert spec is not None, f"stage {self.stage} receives no {direction} transfers"
        buffers = spec.empty(self.device, grads=direction is ActionKind.B)
        tags = [_tag(direction, unit, i) for i in range(len(buffers))]
        src = self.base + self.stage - direction.step
        receive = post_receives(buffers, src, tags, self._groups.get(direction))
        self._posted[(direction, unit)] = receive

    def take(self, direction: ActionKind, unit: int) -> Packed:
        self.post(direction, unit)
        if direction is ActionKind.B:  # the next stage had this unit's activations
            self._sends.settle((ActionKind.F, unit))
        return self._posted.pop((direction, unit)).wait()

    def send(self, direction: ActionKind, unit: int, tensors: Packed) -> None:
        self._check_count(len(tensors))
        tags = [_tag(direction, unit, i) for i in range(len(tensors))]
        dst = self.base + self.stage + direction.step
        self._sends.start((direction, unit), tensors, dst, tags, self._groups.get(direction))

    def progress(self) -> None:
        self._sends.poll()

    def _check_count(self, tensors: int) -> None:
        if tensors > MAX_TENSORS_PER_CUT:
            raise ConfigError(
                f"{tensors} tensors cross a cut of stage {self.stage}, more than the "
                f"{MAX_TENSORS_PER_CUT} the runtime tags: cut the model where fewer tensors "
                "pass between layers ({balance})"
            )

    def finish(self, abandon: Collection[tuple[ActionKind, int]] = ()) -> None:
        """Wait for every send but those in ``abandon`` (saved in a checkpoint instead)."""
        self._sends.wait(abandon)

    def settle(self) -> None:
        """A synchronous step ended: every send of it is received, or will be (its peers
        need nothing more of this rank to finish the step)."""
        self._sends.wait()


class StageWires:
    """What joins this rank's stage to the others, in the initialized default process group:
    the training and held-out transports, the tied parameters' exchange and the gathering
    of gradient norms, each in process groups of their own.

    ``split_directions`` (default: with NCCL) sends forward and backward transfers through
    two process groups of their own: NCCL runs one pair's sends and receives on one stream
    in the order they were issued, and a send may wait there for its receive, so a receive
    posted ahead (or a SEND the schedule issues before a RECV the peer issues first) could
    deadlock the pair. One group per direction gives each stream one kind of transfer, in
    unit order on both ends. Every rank must build its wires at the same point (creating a
    group is collective), from the same ``shared`` parameters.

    With ``mesh`` (a replicated pipeline), this rank is stage ``mesh.stage`` of replica
    ``mesh.replica``: its transfers go to the neighbouring stages of its own replica, its
    gradient norms are gathered among them (the mesh's pipe group).
    """

    def __init__(
        self,
        infos: list[LayerInfo],
        balance: tuple[int, ...],
        shared: list[SharedParam],
        device: torch.device,
        split_directions: bool | None = None,
        mesh: ReplicaMesh | None = None,
    ) -> None:
        stage, stages = rank_and_world()  # without replicas each process is one stage
        base, replicas = 0, 1
        if mesh is not None:
            base, stage, stages, replicas = (
                mesh.global_rank(0),
                mesh.stage,
                mesh.stages,
                mesh.replicas,
            )
        if split_directions is None:
            split_directions = backend_name() == "nccl"
        self._groups = direction_groups(split_directions)
        # Held-out batches mid-run and the stages' gradient norms travel apart from
        # training's transfers: NCCL matches a receive posted ahead with whatever its peer
        # sends next.
        eval_group, norm_group = new_groups(2) or (None, None)
        self._side = (eval_group, norm_group) if eval_group is not None else None
        self._norm_group = mesh.pipe_group if mesh is not None else norm_group
        holders = {s.holders for s in shared}
        pairs = sorted({(a, b) for hs in holders for a in hs for b in hs if a != b})
        # Each replica's holders in groups of their own (keyed here by stage).
        made = pair_groups(
            [(d * stages + a, d * stages + b) for d in range(replicas) for a, b in pairs]
        )
        self._tied_groups = {(a - base, b - base): group for (a, b), group in made.items()}
        start, stop = stage_bounds(balance)[stage]
        specs = (
            infos[start - 1].output if stage > 0 else None,
            infos[stop - 1].output if stage < stages - 1 else None,
        )
        self.world = stages  # the processes of this pipeline: its stages
        self.transport = DistTransport(stage, *specs, device, self._groups, base)
        self.eval_transport = DistTransport(
            stage,
            *specs,
            device,
            (eval_group, eval_group) if eval_group is not None else None,
            base,
        )
        self.exchange = DistExchange(stage, self._tied_groups, device, base)

    def joins(self) -> dict[str, Any]:
        """The StageExecutor arguments these wires give, besides the training transport."""
        return {
            "exchange": self.exchange,
            "gather_norms": self.gather_norms,
            "eval_transport": self.eval_transport,
        }

    def gather_norms(self, step: int, mine: float) -> list[float]:
        """Every stage's squared gradient norm of ``step`` (a collective of all stages)."""
        return all_gather(mine, self.world, self._norm_group)

    def close(self) -> None:
        destroy_groups(self._groups)
        destroy_groups(self._side)
        destroy_groups(tuple(self._tied_groups.values()))


def run_stage_rank(
    config: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    progress: bool = False,
    split_directions: bool | None = None,
    checkpoint: CheckpointPlan | None = None,
    resume: tuple[str, int] | None = None,
    memory: MemoryFactory | None = None,
) -> PipelineResult | None:
    """Run this rank's stage of ``config`` in the initialized default process group.

    Rank k runs stage k; a one-stage pipeline runs without a process group. With D
    replicas (``PipelineConfig.replicas``), rank ``d * K + k`` runs stage k of replica d.
    ``checkpoint`` and ``resume`` are the emulator's (:class:`Emulator`), file for file.
    Returns the combined result on rank 0 (gathered from every rank), None elsewhere.
    ``split_directions``: see :class:`StageWires`. ``memory`` builds the stage's keeper of
    saved tensors (a stage that swaps: pipeswap.pipeline.stage_memory).
    """
    config = resolve_pipeline(config)
    pipeline = config.require_pipeline()
    rank, world = rank_and_world()
    n, replicas = pipeline.num_stages, pipeline.replicas
    of_replicas = f" of {replicas} replicas" if replicas > 1 else ""
    require(
        world == pipeline.num_ranks,
        f"{world} ranks joined a {n}-stage pipeline{of_replicas}: start one rank per stage"
        f"{' of each replica' if replicas > 1 else ''} ({{nproc}} {pipeline.num_ranks})",
    )
    replica, stage = divmod(rank, n)
    device = torch.device(device)
    if device.type == "cuda":
        # NCCL sends, receives and object gathers run on the current device: make it ours.
        torch.cuda.set_device(device)
    # Every rank builds the full model: every rank finds the same tied parameters and
    # joins the same pair groups (creating a group is collective).
    shared = find_shared(build_meta_model(config), pipeline.stage_balance)
    threads = single_threaded() if device.type == "cpu" else nullcontext()
    with threads:
        infos = inspect_layers(config)
        mesh = ReplicaMesh(replicas, n, device.type) if replicas > 1 else None
        wires = StageWires(infos, pipeline.stage_balance, shared, device, split_directions, mesh)
        transport, exchange = wires.transport, wires.exchange
        schedule = pipeline_schedule(config)
        model = build_full_model(config, device)
        request = None
        if checkpoint is not None:
            request = StopRequest(checkpoint.directory, world, config.steps, decider=rank == 0)
        # The last stage knows each step's loss: it writes the log.
        log = StepLog(config.log, config.steps) if rank == n - 1 else None
        executor = StageExecutor(
            config,
            stage,
            schedule,
            model,
            infos,
            transport,
            device=device,
            checkpoint=checkpoint,
            stop=request,
            **wires.joins(),
            log=log,
            replica=replica,
            average=mesh,
            memory=memory,
        )
        first = (
            0 if resume is None else restore_stage(executor, load_rank(resume[0], resume[1], rank))
        )
        barrier()
        actions = schedule.actions[stage][first:]
        bar = progress_bar(config.steps, "train (rank 0)", enabled=progress and rank == 0)
        if bar is not None and resume is not None:
            bar.update(resume[1])
        meter = StageMeter(executor, metered_steps(config))
        executor.start_clock()
        meter.on()  # the posted receives count too: the whole loop is this stage's
        try:
            run_actions(executor, transport, actions, bar, fault_hook(rank), meter)
        except StageAtCut as cut:
            if log is not None:
                log.close()
            # The checkpoint holds the messages that cross the cut; the rest must arrive.
            transport.finish(abandon=executor.cuts.crossing)
            exchange.finish(abandon=executor.tied.crossing if executor.tied is not None else ())
            assert checkpoint is not None and request is not None  # a cut needs both
            raise RunStopped(checkpoint.directory, cut.args[0], request.signal_name) from None
        finally:
            meter.off()
            if request is not None:
                request.close()
        executor.finish_training()
        if bar is not None:
            bar.close()
        for unit in executor.scorer.units():
            executor.scorer.evaluate(unit)
        executor.scorer.close_log()
        result = executor.finish()
        result.peak_resident_bytes = meter.peak_bytes
    gathered: list[StageResult] | None = gather_to_rank0(result, rank, world)
    wires.close()
    if rank != 0:
        return None
    assert gathered is not None
    save_trained(config, [result.state for result in gathered[:n]])
    wall = max(r.wall_s for r in gathered)
    resumed = 0 if resume is None else resume[1]
    return combine(config, gathered, mode="pipeline", task=model.task, wall_s=wall, resumed=resumed)


def run_actions(
    executor: StageExecutor,
    transport: Transport,
    actions: tuple[Action, ...],
    bar: Any,
    after_step: Callable[[int], None] | None,
    meter: StageMeter | None = None,
) -> None:
    """Run ``actions`` of this rank in order, posting each pass's receives and the next
    pass's ahead (so they arrive while it computes); ``meter``, on (the caller's), reads
    the device over them, each step's end left out (pipeswap.pipeline.stage_meter)."""
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
                if actions[j].kind.is_receive:
                    transport.post(actions[j].kind.direction, actions[j].unit)
            posted_upto = max(posted_upto, horizon)
        executor.run(action, end_step=False)
        if action.kind is ActionKind.UPDATE:
            if isinstance(transport, DistTransport) and not executor.pipeline.asynchronous:
                transport.settle()
            if meter is not None:
                meter.ran(action)
            with meter.aside() if meter is not None else nullcontext():
                executor.end_step(action.unit)
            if bar is not None:
                bar.update(1)
            if after_step is not None:
                after_step(action.unit)
