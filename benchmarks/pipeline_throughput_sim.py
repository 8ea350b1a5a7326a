"""Simulated training throughput on PCIe servers: data parallelism against pipelines.

Run from the repository root:

    .venv/bin/python benchmarks/pipeline_throughput_sim.py              # writes the table
    .venv/bin/python benchmarks/pipeline_throughput_sim.py --quick --out /tmp/sim.md

Every figure is a steady-state rate in samples/s: each configuration is simulated for S
and 2S steps and the rate is the samples of the extra S steps over the extra time, so
pipeline fill and drain do not count. Profiles are estimates (pipeswap.profiling.estimate,
float32, SGD with momentum); topologies are the presets with Gen3 PCIe and each GPU's
memory from its spec.

- Data parallelism (DP): every GPU runs the whole model on ``b`` samples, gradients are
  ring-allreduced in 25 MiB buckets overlapped with backward (PyTorch DDP), then every
  GPU updates. ``DP no overlap``: one allreduce after the backward (no buckets).
- gpipe / 1f1b: a mini-batch of ``N * b`` samples (DP's global batch) in N micro-batches
  of ``b``; one update per mini-batch after the flush.
- async-1f1b: mini-batches of ``b`` samples pipelined with no flush, an update per
  mini-batch per stage; memory counts SpecTrain's one extra weight copy.
- 2bw: PipeDream-2BW, a mini-batch of ``N * b`` in N micro-batches of ``b`` pipelined
  with no flush, one update per mini-batch applied one update late; memory counts the
  second weight version (``stash``) and up to 2N micro-batches in flight.
- Stages are cut by the partitioner (slowest stage minimal, each stage within the GPU's
  memory); stage k runs on GPU k.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from _common import RESULTS_DIR, header

from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.hardware.presets import preset
from pipeswap.hardware.topology import Topology
from pipeswap.jsonio import write_atomic
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import SCHEDULE_NAMES, schedule_kind
from pipeswap.schedule.partition import partition
from pipeswap.schedule.taskgraph import pipeline_graph
from pipeswap.schedule.timetable import build_schedule
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.iteration import build_iteration_graph
from pipeswap.swap.plan.workload import Workload, workload_from_profile
from pipeswap.swap.swap_config import DEFAULT_BUCKET_BYTES

RESULTS = RESULTS_DIR / "pipeline_throughput_sim.md"
MODELS = ("vgg16", "resnet152", "gpt2-medium")
GPUS = ("v100-32gb", "rtx2080ti")
TOPOLOGIES = ("switch-4", "single-root-8")
PIPELINES = SCHEDULE_NAMES
# Weight mode each schedule runs with here (its extra weight memory follows from it).
WEIGHT_MODES = {"gpipe": "stale", "1f1b": "stale", "async-1f1b": "spectrain", "2bw": "stash"}
# SGD with momentum reads weight, gradient and momentum and writes weight and momentum.
UPDATE_ACCESSES = 5
MEMORY_EFFICIENCY = 0.7  # as pipeswap.profiling.estimate's elementwise kernels
SWEEP_BATCHES = (2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Rate:
    """A steady-state rate, or why there is none (``note``), and the batch it ran at."""

    samples_per_s: float | None
    batch: int
    note: str = ""

    def cell(self, default_batch: int) -> str:
        if self.samples_per_s is None:
            return self.note
        text = f"{self.samples_per_s:,.1f}"
        return text if self.batch == default_batch else f"{text} (b={self.batch})"


def update_seconds(param_bytes: int, gpu: str) -> float:
    """A memory-bound SGD-momentum step over ``param_bytes`` of weights."""
    return UPDATE_ACCESSES * param_bytes / (gpu_spec(gpu).hbm_bytes_per_s * MEMORY_EFFICIENCY)


def fits(profile: Profile, memory_bytes: int) -> bool:
    """Whether one data-parallel replica (resident state plus every saved tensor) fits."""
    return profile.resident_bytes + profile.saved_bytes <= memory_bytes


def dp_workload(profile: Profile, update_s: float) -> Workload:
    """The data-parallel view of ``profile``, with a step of ``update_s`` and the memory
    of saved tensors only (no workspace), as the pipelines' stage memory counts it."""
    workload = workload_from_profile(profile, optimizer_step_s=update_s)
    return dataclasses.replace(workload, transient=(0,) * workload.num_layers)


def steady_rate(build: object, steps: int, samples_per_step: int, topology: Topology) -> float:
    """Samples/s between ``steps`` and ``2 * steps`` simulated steps."""
    short = simulate(build(steps), topology).makespan_s  # type: ignore[operator]
    long = simulate(build(2 * steps), topology).makespan_s  # type: ignore[operator]
    return steps * samples_per_step / (long - short)


def data_parallel_rate(
    model: str,
    gpu: str,
    batch: int,
    topology: Topology,
    *,
    overlap: bool = True,
    gpus: int | None = None,
) -> Rate:
    """DP on the first ``gpus`` GPUs (default all) at ``batch`` per GPU, halving until it fits."""
    memory = gpu_spec(gpu).memory_bytes
    while batch >= 1:
        profile = estimate(model, batch, gpu=gpu)
        if fits(profile, memory):
            break
        batch //= 2
    else:
        return Rate(None, 0, "does not fit")
    placement = topology.gpus[: gpus or len(topology.gpus)]
    workload = dp_workload(profile, update_seconds(profile.param_bytes, gpu))
    bucket = DEFAULT_BUCKET_BYTES if overlap else None

    def build(steps: int) -> object:
        return build_iteration_graph(workload, placement, bucket_bytes=bucket, steps=steps)

    return Rate(steady_rate(build, 1, len(placement) * batch, topology), batch)


def pipeline_rate(
    model: str, gpu: str, batch: int, topology: Topology, schedule_name: str
) -> tuple[Rate, tuple[int, ...]]:
    """A schedule over every GPU of ``topology`` at ``batch`` samples per unit, halving the
    batch until some cut fits every stage in memory; also the balance the partitioner chose."""
    n = len(topology.gpus)
    micro = schedule_kind(schedule_name).default_micro_batches(n)
    weights = WEIGHT_MODES[schedule_name]
    while batch >= 1:
        profile = estimate(model, batch, gpu=gpu).scaled(micro)
        try:
            cut = partition(
                profile,
                n,
                memory_cap_bytes=gpu_spec(gpu).memory_bytes,
                schedule=schedule_name,
                micro_batches=micro,
                weights=weights,
            )
            break
        except PipeswapError:
            batch //= 2
    else:
        return Rate(None, 0, "does not fit"), ()
    update_s = max(
        update_seconds(sum(la.param_bytes for la in profile.layers[a:b]), gpu)
        for a, b in cut.bounds
    )

    def build(steps: int) -> object:
        schedule = build_schedule(schedule_name, n, steps, micro)
        return pipeline_graph(
            schedule, profile, topology, cut.balance, update_s=update_s, weights=weights
        )

    steps = {"gpipe": 2, "1f1b": 2, "async-1f1b": 2 * n}.get(schedule_name, 4)
    return Rate(steady_rate(build, steps, micro * batch, topology), batch), cut.balance


def server(name: str, gpu: str) -> Topology:
    return preset(name, gpu_memory_bytes=gpu_spec(gpu).memory_bytes, spec=gpu)


def default_batch(model: str) -> int:
    from pipeswap.models import model_spec

    return model_spec(model).default_batch


def main_table(
    models: tuple[str, ...],
    gpus: tuple[str, ...],
    topologies: tuple[str, ...],
    batch_of: dict[str, int],
) -> tuple[str, list[dict[str, object]]]:
    lines = [
        "| model | GPU | server | N | b | 1 GPU | DP | DP no overlap | gpipe | 1f1b | async-1f1b "
        "| 2bw | async / DP | async / DP no overlap | async / (N x 1 GPU) | async balance |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows: list[dict[str, object]] = []
    for model in models:
        b = batch_of[model]
        for gpu in gpus:
            for name in topologies:
                topology = server(name, gpu)
                n = len(topology.gpus)
                single = data_parallel_rate(model, gpu, b, topology, gpus=1)
                dp = data_parallel_rate(model, gpu, b, topology)
                dp_plain = data_parallel_rate(model, gpu, b, topology, overlap=False)
                pipes: dict[str, Rate] = {}
                balance: tuple[int, ...] = ()
                for schedule_name in PIPELINES:
                    pipes[schedule_name], cut = pipeline_rate(
                        model, gpu, b, topology, schedule_name
                    )
                    if schedule_name == "async-1f1b":
                        balance = cut
                a = pipes["async-1f1b"].samples_per_s
                ideal = None if single.samples_per_s is None else n * single.samples_per_s
                cells = [
                    single.cell(b),
                    dp.cell(b),
                    dp_plain.cell(b),
                    *(pipes[s].cell(b) for s in PIPELINES),
                    _ratio(a, dp.samples_per_s),
                    _ratio(a, dp_plain.samples_per_s),
                    _ratio(a, ideal),
                ]
                lines.append(
                    f"| {model} | {gpu} | {name} | {n} | {b} | "
                    + " | ".join(cells)
                    + f" | {','.join(map(str, balance)) or '-'} |"
                )
                rows.append(
                    {
                        "model": model,
                        "gpu": gpu,
                        "server": name,
                        "n": n,
                        "single": single,
                        "dp": dp,
                        "dp_plain": dp_plain,
                        **pipes,
                    }
                )
                print(lines[-1], flush=True)
    return "\n".join(lines), rows


def sweep_table(
    model: str, gpu: str, topologies: tuple[str, ...], batches: tuple[int, ...]
) -> tuple[str, list[dict[str, object]]]:
    lines = [
        "| server | b | DP | DP no overlap | async-1f1b | async / DP | async / DP no overlap |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows: list[dict[str, object]] = []
    for name in topologies:
        topology = server(name, gpu)
        for b in batches:
            dp = data_parallel_rate(model, gpu, b, topology)
            dp_plain = data_parallel_rate(model, gpu, b, topology, overlap=False)
            pipe, _ = pipeline_rate(model, gpu, b, topology, "async-1f1b")
            lines.append(
                f"| {name} | {b} | {dp.cell(b)} | {dp_plain.cell(b)} | {pipe.cell(b)} "
                f"| {_ratio(pipe.samples_per_s, dp.samples_per_s)} "
                f"| {_ratio(pipe.samples_per_s, dp_plain.samples_per_s)} |"
            )
            rows.append(
                {"server": name, "b": b, "dp": dp, "dp_plain": dp_plain, "async-1f1b": pipe}
            )
            print(lines[-1], flush=True)
    return "\n".join(lines), rows


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _best_ratio(rows: list[dict[str, object]], baseline: str) -> tuple[float, dict[str, object]]:
    best: tuple[float, dict[str, object]] = (0.0, {})
    for row in rows:
        a = row["async-1f1b"].samples_per_s  # type: ignore[attr-defined]
        d = row[baseline].samples_per_s  # type: ignore[attr-defined]
        if a is not None and d is not None and a / d > best[0]:
            best = (a / d, row)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one model, one GPU, switch-4, small batch (seconds; for tests)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"table file (default {RESULTS})")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if args.quick:
        models, gpus, topologies = ("vgg16",), ("v100-32gb",), ("switch-4",)
        batch_of = {"vgg16": 8}
        sweep: tuple[int, ...] = (4, 8)
    else:
        models, gpus, topologies = MODELS, GPUS, TOPOLOGIES
        batch_of = {m: default_batch(m) for m in models}
        sweep = SWEEP_BATCHES
    main_text, rows = main_table(models, gpus, topologies, batch_of)
    sweep_text, sweep_rows = sweep_table("vgg16", "v100-32gb", topologies, sweep)
    if args.no_write:
        return 0
    text = (
        header("Simulated pipeline throughput on PCIe servers", "pipeline_throughput_sim.py", argv)
        + _explanation(batch_of)
        + "\n## Throughput (samples/s, steady state)\n\n"
        + main_text
        + "\n"
        + "\n## VGG-16 on V100: async-1f1b against DP as the per-GPU batch shrinks\n\n"
        + sweep_text
        + "\n"
        + _discussion(rows, sweep_rows)
    )
    write_atomic(args.out, text)
    print(f"wrote {args.out}")
    return 0


def _explanation(batch_of: dict[str, int]) -> str:
    batches = ", ".join(f"{m} b={b}" for m, b in batch_of.items())
    return (
        "Every rate is samples/s in steady state, from the discrete-event simulator "
        "(`pipeswap.sim`) running task graphs built from estimated profiles "
        "(`pipeswap.profiling.estimate`: float32, SGD with momentum, the GPU's FP32 peak "
        "at 60% for matrix ops and its memory bandwidth at 70% for the rest). Each "
        "configuration is simulated for S and 2S steps; the rate is the extra samples over "
        "the extra time, so pipeline fill and drain do not count.\n\n"
        f"Per-GPU batch `b` (the zoo's defaults): {batches}. Servers: the `switch-4` and "
        "`single-root-8` presets, Gen3 x16 links (12 GB/s per direction), each GPU with its "
        "spec's memory (V100 32 GiB, RTX 2080 Ti 11 GiB); N is the number of GPUs.\n\n"
        "- **1 GPU**: the whole model on one GPU at `b` (no communication).\n"
        "- **DP**: each GPU runs the whole model on `b` samples; gradients are "
        "ring-allreduced in 25 MiB buckets as the backward produces them, overlapped with "
        "the rest of the backward (PyTorch DDP's default), then each GPU applies a "
        "memory-bound SGD update (`pipeswap.swap.plan.workload`). **DP no overlap**: one "
        "allreduce of all gradients after the backward.\n"
        "- **gpipe / 1f1b**: mini-batch `N*b` (the global batch of DP on N GPUs) in N "
        "micro-batches of `b`, flush and update every mini-batch.\n"
        "- **async-1f1b**: mini-batches of `b` pipelined with no flush (PipeDream / "
        "SpecTrain); its memory includes weight prediction's one extra weight copy.\n"
        "- **2bw**: PipeDream-2BW: mini-batch `N*b` in N micro-batches of `b` pipelined "
        "with no flush, one update per mini-batch that applies the gradient of the weights "
        "one update old; its memory includes the second weight version and up to 2N "
        "micro-batches of activations in flight.\n"
        "- The partitioner cuts the model into N stages, minimising the slowest stage's "
        "compute with every stage within the GPU's memory; `async balance` lists layers "
        "per stage. Stage k runs on GPU k; activations and gradients cross the PCIe tree "
        "as p2p transfers.\n"
        "- **When something does not fit**: DP needs the whole model plus one batch's "
        "activations on every GPU; a pipeline stage needs its share of the model plus the "
        "activations of every unit in flight (N units on the first stage of gpipe, 1f1b "
        "with N micro-batches and async-1f1b). We do not add swapping to any baseline here "
        "(the swap planner's benchmarks cover that). Where a configuration exceeds the "
        "GPU's memory at `b`, it runs at the largest power-of-two fraction of `b` that "
        "fits, shown as `(b=...)`, and its samples/s are at that batch. `does not fit`: not "
        "even one sample fits.\n"
    )


def _discussion(rows: list[dict[str, object]], sweep_rows: list[dict[str, object]]) -> str:
    best, where = _best_ratio(rows, "dp")
    best_plain, where_plain = _best_ratio(rows + sweep_rows, "dp_plain")

    def name(row: dict[str, object]) -> str:
        if "model" in row:
            return f"{row['model']} on {row['gpu']} {row['server']}"
        return f"vgg16 on v100-32gb {row['server']} at b={row['b']}"

    return (
        "\n## Beside the published claims\n\n"
        "SpecTrain's paper reports up to **8.91x** over data parallelism on 4 GPUs, the "
        "thesis up to **15.77x**. Our best async-1f1b / DP ratio is "
        f"**{best:.2f}x** ({name(where) if where else '-'}) against DDP-style DP, and "
        f"**{best_plain:.2f}x** ({name(where_plain) if where_plain else '-'}) against DP "
        "without overlap. We do not reproduce the published factors, and the table says "
        "why:\n\n"
        "1. **A pipeline of N GPUs is at most N times one GPU.** async-1f1b has no bubble, "
        "so its ceiling is N x the 1-GPU rate (column `async / (N x 1 GPU)` shows how close "
        "it gets). A speedup of 8.91x over DP on 4 GPUs therefore means the DP baseline "
        "ran at under 4 / 8.91 = 45% of *one* GPU's speed, i.e. slower than not "
        "parallelising at all: DP must have been dominated by weight synchronisation, or "
        "by the batch it could fit. Our DP overlaps a ring allreduce with the backward, "
        "and at these batches the backward is longer than the allreduce (VGG-16: 553 MB "
        "of gradients, 69 ms of ring on 4 GPUs at 12 GB/s, against about 0.5 s of backward "
        "at b=64 on a V100), so DP scales almost linearly and the pipeline cannot beat it.\n"
        "2. **Where the pipeline falls short of its ceiling**: models cut at layer "
        "granularity do not balance (VGG-16 has 16 layers of very unequal cost; on 8 GPUs "
        "the slowest stage bounds the rate), and activations cross PCIe (VGG-16's early "
        "layers emit hundreds of MB per mini-batch). gpipe and 1f1b with N micro-batches "
        "also idle for the bubble (N-1)/(2N-1) of each step, about half.\n"
        "3. **What would make DP slow enough** for the published factors, none of which "
        "our simulated baseline has: tiny per-GPU batches with no overlap (the sweep: the "
        "ratio against DP without overlap grows as `b` shrinks), synchronisation through "
        "host memory or a parameter server instead of a peer-to-peer ring (GeForce cards "
        "such as the RTX 2080 Ti have no PCIe peer-to-peer, so NCCL stages every transfer "
        "through the host, which doubles the traffic on the shared uplinks; we model "
        "direct GPU-to-GPU transfers), or a model too large for one GPU, where DP needs "
        "swapping or a tiny batch at which real kernels run far below peak (our roofline "
        "estimate scales almost linearly with the batch, so it does not capture that).\n"
        "4. The published experiments' exact models, batch sizes and DP implementation are "
        "not in our reference material (reference/systems.md gives only the figures), so "
        "we cannot rebuild their setting; these tables are our own setting, stated in "
        "full above.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
