"""Simulator speed: tasks per second for data-parallel training with swaps on dual-root-8.

Run from the repository root:

    .venv/bin/python benchmarks/sim_speed.py                  # 10k, 30k, 100k tasks
    .venv/bin/python benchmarks/sim_speed.py --tasks 100000 --no-write

Each iteration, every GPU runs ``layers`` forward computes (each allocating its
activations), swaps ``swapped`` of them out to host memory (d2h, freeing them), runs the
backward pass in reverse with a prefetch (h2d) two layers ahead of each swapped layer,
and the GPUs allreduce the gradients in ``buckets`` ring allreduces as backward proceeds.
Durations and sizes are drawn from a seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from pathlib import Path

from pipeswap.hardware.presets import preset
from pipeswap.jsonio import write_atomic
from pipeswap.sim.builder import GraphBuilder
from pipeswap.sim.engine import simulate
from pipeswap.sim.graph import TaskGraph

TOPOLOGY = "dual-root-8"
# Tight enough that prefetches wait for memory (peak is 2.96 GiB without a limit).
GPU_MEMORY_BYTES = 5 * 2**29
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "sim_speed.md"


def training_graph(
    num_tasks: int,
    gpus: list[str],
    *,
    seed: int = 0,
    layers: int = 24,
    swapped: int = 8,
    buckets: int = 4,
) -> TaskGraph:
    """Iterations of swap-enabled data-parallel training until ``num_tasks`` tasks exist."""
    rng = random.Random(seed)
    b = GraphBuilder()
    swap_layers = set(range(1, layers, max(1, layers // swapped)))
    # Backward runs from the last layer down; bucket 0 holds the last layers' gradients.
    bucket_of = [min(buckets - 1, (layers - 1 - ly) * buckets // layers) for ly in range(layers)]
    previous_allreduces: list[str] = []
    iteration = 0
    while len(b) < num_tasks:
        act_bytes = [rng.randrange(20, 200) * 2**20 for _ in range(layers)]
        fwd_s = [rng.uniform(1e-3, 4e-3) for _ in range(layers)]
        grad_bytes = [rng.randrange(5, 60) * 2**20 for _ in range(buckets)]
        swap_out: dict[tuple[str, int], str] = {}
        last_fwd: dict[str, str] = {}
        for gpu in gpus:
            prev = None
            for layer in range(layers):
                deps = [prev] if prev else list(previous_allreduces)
                prev = b.compute(
                    gpu,
                    fwd_s[layer],
                    deps=deps,
                    alloc_bytes=act_bytes[layer],
                    id=f"i{iteration}.{gpu}.f{layer}",
                )
                if layer in swap_layers:
                    swap_out[(gpu, layer)] = b.d2h(
                        gpu, act_bytes[layer], deps=[prev], free_bytes=act_bytes[layer]
                    )
            last_fwd[gpu] = prev  # type: ignore[assignment]
        bwd: dict[tuple[str, int], str] = {}
        allreduces = []
        for bucket in range(buckets):
            bucket_layers = [ly for ly in reversed(range(layers)) if bucket_of[ly] == bucket]
            ends = []
            for gpu in gpus:
                for layer in bucket_layers:
                    deps = [bwd.get((gpu, layer + 1), last_fwd[gpu])]
                    if layer in swap_layers:
                        trigger = bwd.get((gpu, layer + 2), last_fwd[gpu])
                        deps.append(
                            b.h2d(
                                gpu,
                                act_bytes[layer],
                                deps=[trigger, swap_out[(gpu, layer)]],
                                alloc_bytes=act_bytes[layer],
                            )
                        )
                    bwd[(gpu, layer)] = b.compute(
                        gpu,
                        2 * fwd_s[layer],
                        deps=deps,
                        free_bytes=act_bytes[layer],
                        id=f"i{iteration}.{gpu}.b{layer}",
                    )
                ends.append(bwd[(gpu, bucket_layers[-1])])
            allreduces.append(b.allreduce(gpus, grad_bytes[bucket], deps=ends))
        previous_allreduces = allreduces
        iteration += 1
    return b.build()


def measure(num_tasks: int, seed: int, repeats: int) -> dict[str, float]:
    topology = preset(TOPOLOGY, gpu_memory_bytes=GPU_MEMORY_BYTES)
    started = time.perf_counter()
    graph = training_graph(num_tasks, topology.gpus, seed=seed)
    build_s = time.perf_counter() - started
    best = float("inf")
    result = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = simulate(graph, topology)
        best = min(best, time.perf_counter() - started)
    assert result is not None
    kinds = ("compute", "d2h", "h2d", "allreduce")
    counts = {kind: sum(t.kind == kind for t in graph.tasks) for kind in kinds}
    ring = 2 * (len(topology.gpus) - 1) * len(topology.gpus)
    transfers = counts["d2h"] + counts["h2d"] + ring * counts["allreduce"]
    return {
        "tasks": len(graph),
        **counts,
        "transfers": transfers,
        "build_s": build_s,
        "simulate_s": best,
        "tasks_per_s": len(graph) / best,
        "makespan_s": result.makespan_s,
    }


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| tasks | compute | d2h | h2d | allreduce | transfers | build s | simulate s | tasks/s "
        "| simulated makespan s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tasks']} | {r['compute']} | {r['d2h']} | {r['h2d']} | {r['allreduce']} "
            f"| {r['transfers']} "
            f"| {r['build_s']:.2f} | {r['simulate_s']:.2f} | {r['tasks_per_s']:,.0f} "
            f"| {r['makespan_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[10_000, 30_000, 100_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS}")
    args = parser.parse_args(argv)
    # benchmarks/ is on sys.path when this file runs as a script; importing it as a module
    # (the slow simulator test does) needs only training_graph, not the shared helpers.
    from _common import machine

    rows = []
    for num_tasks in args.tasks:
        rows.append(measure(num_tasks, args.seed, args.repeats))
        print(table(rows[-1:]).splitlines()[-1] if rows[:-1] else table(rows), flush=True)
    if not args.no_write:
        given = sys.argv[1:] if argv is None else argv
        command = ".venv/bin/python benchmarks/sim_speed.py " + " ".join(given)
        text = (
            "# Simulator speed\n\n"
            f"Command: `{command.strip()}`  \n"
            f"Machine: {machine()}  \n"
            f"Date: {datetime.date.today().isoformat()}\n\n"
            f"Topology `{TOPOLOGY}` (Gen3 PCIe, 2.5 GiB per GPU). Each iteration every GPU "
            "runs 24 forward and 24 backward computes, swaps 8 activations out (d2h) and "
            "prefetches them back (h2d), and the 8 GPUs run 4 ring allreduces (14 steps of "
            "8 concurrent transfers each); `transfers` counts the point-to-point flows. "
            "Prefetches wait for memory under the 2.5 GiB limit. `simulate s` is the best of "
            f"{args.repeats} runs of `simulate()`; `build s` builds the graph.\n\n"
            + table(rows)
            + "\n"
        )
        write_atomic(RESULTS, text)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
