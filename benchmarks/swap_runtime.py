"""Swap runtime cost: hooks with nothing swapped, everything swapped; CUDA comparisons on a GPU.

Run from the repository root:

    .venv/bin/python benchmarks/swap_runtime.py                 # writes docs/results/swap_runtime.md
    .venv/bin/python benchmarks/swap_runtime.py --repeats 5 --no-write

CPU table: one training step (forward, loss, backward, SGD step) of each model, plain
PyTorch against the SwapExecutor with a plan that swaps nothing (the cost of the hooks
and the accounting) and with plans that swap every saved tensor (prefetched just in time,
or all at the forward/backward turn). The variants run in alternating order, one step
each per repetition, after warm-up; the table gives each variant's median and its ratio
to plain PyTorch's median, all from one run.

CUDA tables (only with a GPU; otherwise the script says "skipped: no CUDA"): step time of
the executor swapping everything against ``torch.autograd.graph.save_on_cpu`` (which swaps
everything too, synchronously, with no prefetch); the simulator's predicted step time
against the measured one for each policy at footprint ratio 1.5; and two ranks sharing one
GPU (so they share its PCIe link) under oblivious, disjoint and bidirectional plans.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipeswap.jsonio import write_atomic
from pipeswap.models import build_model
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.swap.runtime.executor import SwapExecutor

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "swap_runtime.md"
HOOK_OVERHEAD_LIMIT = 0.03  # the bound: hooks cost at most 3% of a step
MODELS = {  # name: (batch, shape keyword arguments)
    "gpt2-tiny": (8, {"seq_len": 64}),
    "resnet18": (8, {"image_size": 32}),
}
VARIANTS = (
    "plain",
    "hooks only",
    "hooks + accounting",
    "swap all, just in time",
    "swap all, at the turn",
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plan(model: Any, records: dict[str, list[Any]], kind: str, budget: int) -> SwapPlan:
    names = list(model.layer_names)
    decisions = []
    if kind != "none":
        for i, name in enumerate(names):
            later = names[i + 1] if i + 1 < len(names) and kind == "jit" else None
            decisions.extend(
                SwapDecision(name, r.index, r.bytes, name, later) for r in records[name]
            )
    return SwapPlan(
        kind, model.name, tuple(names), (GpuPlan("gpu0", 0, budget, 0.0, tuple(decisions)),)
    )


def _runner(name: str, variant: str, device: torch.device) -> Callable[[], None]:
    """One training step of ``name`` under ``variant``, as a closure."""
    batch, shape = MODELS[name]
    model = build_model(
        name,
        device=device,
        **({"image_size": shape["image_size"]} if "image_size" in shape else {}),
    )
    inputs, targets = model.example_batch(batch, device=device, **shape)
    inputs = inputs.clone(memory_format=torch.contiguous_format)
    targets = targets.clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def forward_loss() -> torch.Tensor:
        return model.loss(model(inputs), targets)

    if variant == "plain":

        def step() -> None:
            forward_loss().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    if variant == "save_on_cpu":

        def step_on_cpu() -> None:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = forward_loss()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step_on_cpu
    records, _ = capture_records(model, forward_loss)
    kind = {
        "hooks only": "none",
        "hooks + accounting": "none",
        "swap all, just in time": "jit",
        "swap all, at the turn": "turn",
    }[variant]
    # "hooks only" is the production path on CUDA (its allocator counts the bytes); the CPU
    # accounting of every saved tensor is measured separately.
    account = variant != "hooks only"
    executor = SwapExecutor(model, _plan(model, records, kind, 2**62), account=account)
    executor.prepare(forward_loss)

    def swapped_step() -> None:
        executor.train_step(forward_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return swapped_step


def alternate(
    runners: dict[str, Callable[[], None]], repeats: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per step of each runner, run in rotating order one step at a time."""
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            runners[name]()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            _sync(device)
            start = time.perf_counter()
            runners[name]()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def cpu_table(repeats: int, warmup: int) -> tuple[str, list[str]]:
    device = torch.device("cpu")
    rows = ["| model | variant | median step ms | ratio to plain |", "|---|---|---:|---:|"]
    verdicts = []
    for name in MODELS:
        medians = alternate(
            {v: _runner(name, v, device) for v in VARIANTS}, repeats, warmup, device
        )
        plain = medians["plain"]
        for variant in VARIANTS:
            ratio = medians[variant] / plain
            rows.append(f"| {name} | {variant} | {medians[variant] * 1e3:.2f} | {ratio:.3f} |")
            print(rows[-1], flush=True)
        hooks = medians["hooks only"] / plain - 1
        overhead = medians["hooks + accounting"] / plain - 1  # the CPU's default path
        verdict = "within" if max(hooks, overhead) <= HOOK_OVERHEAD_LIMIT else "OVER"
        verdicts.append(
            f"{name}: with nothing swapped the hooks cost {hooks * 100:+.1f}% of a step, "
            f"{overhead * 100:+.1f}% with the CPU accounting ({verdict} the "
            f"{HOOK_OVERHEAD_LIMIT:.0%} bound)"
        )
        print(verdicts[-1], flush=True)
    return "\n".join(rows), verdicts


def cuda_sections(repeats: int, warmup: int) -> str:
    """The GPU comparisons; each is a table, or the line saying why it was skipped."""
    if not torch.cuda.is_available():
        print("skipped: no CUDA", flush=True)
        return "## CUDA\n\nskipped: no CUDA (PyTorch sees no GPU on this machine)\n"
    device = torch.device("cuda")
    parts = ["## CUDA: executor against save_on_cpu\n"]
    rows = ["| model | variant | median step ms | ratio to plain |", "|---|---|---:|---:|"]
    for name in MODELS:
        variants = ("plain", "save_on_cpu", "swap all, just in time", "swap all, at the turn")
        medians = alternate(
            {v: _runner(name, v, device) for v in variants}, repeats, warmup, device
        )
        for variant in variants:
            rows.append(
                f"| {name} | {variant} | {medians[variant] * 1e3:.2f} | "
                f"{medians[variant] / medians['plain']:.3f} |"
            )
            print(rows[-1], flush=True)
    parts.append("\n".join(rows) + "\n")
    parts.append("\n## CUDA: predicted against measured step time\n")
    parts.append(_predicted_vs_measured() + "\n")
    parts.append("\n## CUDA: two ranks sharing one GPU\n")
    parts.append(_two_ranks_one_gpu() + "\n")
    return "\n".join(parts)


def _predicted_vs_measured() -> str:
    from pipeswap.hardware.detect import detect_topology
    from pipeswap.hardware.presets import preset
    from pipeswap.profiling.measure import measure
    from pipeswap.swap.plan.planner import make_plan
    from pipeswap.swap.swap_config import SwapConfig
    from pipeswap.train_config import TrainConfig
    from pipeswap.training.dp_rank import train_rank
    from pipeswap.training.job import ModelJob

    rows = ["| model | policy | predicted ms | measured ms | error % |", "|---|---|---:|---:|---:|"]
    topology = detect_topology() or preset("switch-4")
    for name, (batch, shape) in MODELS.items():
        profile = measure(name, batch, device="cuda", **shape)
        job = ModelJob(
            name, batch, seq_len=shape.get("seq_len"), image_size=shape.get("image_size")
        )
        for policy in ("oblivious", "disjoint", "auto"):
            plan = make_plan(profile, topology, policy=policy, gpus=1, footprint_ratio=1.5).plan
            result = train_rank(
                job,
                plan,
                TrainConfig(job.model, steps=12, device="cuda", swap=SwapConfig()),
                profile=profile,
            )
            measured = statistics.median(result.step_s[2:])
            predicted = plan.predicted_iteration_s
            rows.append(
                f"| {name} | {policy} | {predicted * 1e3:.2f} | {measured * 1e3:.2f} | "
                f"{(predicted / measured - 1) * 100:+.1f} |"
            )
            print(rows[-1], flush=True)
    return "\n".join(rows)


def _two_ranks_one_gpu() -> str:
    from pipeswap.dist.launch import spawn
    from pipeswap.hardware.presets import preset
    from pipeswap.profiling.measure import measure
    from pipeswap.swap.plan.planner import make_plan
    from pipeswap.training.dp_result import measured_step_s
    from pipeswap.training.job import ModelJob

    name = "gpt2-tiny"
    batch, shape = MODELS[name]
    profile = measure(name, batch, device="cuda", **shape)
    job = ModelJob(name, batch, seq_len=shape["seq_len"])
    rows = ["| policy | predicted ms | measured ms |", "|---|---:|---:|"]
    for policy in ("oblivious", "disjoint", "bidirectional"):
        plan = make_plan(
            profile, preset("switch-4"), policy=policy, gpus=2, footprint_ratio=1.5
        ).plan
        launched = spawn(_shared_gpu_rank, 2, job, plan, profile, backend="gloo", timeout_s=120)
        if not launched.ok:
            rows.append(f"| {policy} | failed: exit codes {launched.exit_codes} | |")
            continue
        measured = measured_step_s(list(launched.results))
        rows.append(f"| {policy} | {plan.predicted_iteration_s * 1e3:.2f} | {measured * 1e3:.2f} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def _shared_gpu_rank(rank: int, world: int, job: Any, plan: SwapPlan, profile: Any) -> Any:
    from pipeswap.swap.swap_config import SwapConfig
    from pipeswap.train_config import TrainConfig
    from pipeswap.training.dp_rank import train_rank

    # Both ranks on GPU 0: local_rank 0 for each; gloo carries the all-reduce.
    return train_rank(
        job,
        plan,
        TrainConfig(job.model, steps=12, device="cuda", swap=SwapConfig()),
        rank=rank,
        world_size=world,
        local_rank=0,
        profile=profile,
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(
                line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.platform()}, {os.cpu_count()} CPUs ({cpu}), {gpu}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21, help="steps timed per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table, verdicts = cpu_table(args.repeats, args.warmup)
    cuda = cuda_sections(args.repeats, args.warmup)
    if not args.no_write:
        given = sys.argv[1:] if argv is None else argv
        command = ".venv/bin/python benchmarks/swap_runtime.py " + " ".join(given)
        shapes = ", ".join(
            f"{name} batch {batch} "
            + " ".join(f"{k.replace('_', ' ')} {v}" for k, v in shape.items())
            for name, (batch, shape) in MODELS.items()
        )
        text = (
            "# Swap runtime cost\n\n"
            f"Command: `{command.strip()}`  \n"
            f"Machine: {machine()}  \n"
            f"Date: {datetime.date.today().isoformat()}\n\n"
            f"## CPU ({args.threads} thread)\n\n"
            f"One training step (forward, loss, backward, SGD step) of {shapes}. `plain` is "
            "PyTorch without the executor; `hooks only` runs the SwapExecutor with a plan "
            "that swaps nothing (saved-tensor hooks and layer hooks, as on CUDA); `hooks + "
            "accounting` adds the CPU's count of the bytes of every saved tensor held (one "
            "finalizer per tensor), which the swap rows also run; "
            "the `swap all` rows swap every saved tensor to the host pool after its layer's "
            "forward and bring it back just in time (after the next layer's backward) or all "
            "at the forward/backward turn. On the CPU a swap is a memory copy each way. Each "
            f"variant ran {args.warmup} untimed steps, then {args.repeats} timed steps in "
            "rotating order; the median is shown with its ratio to plain's median, all from "
            "one run. The machine's two cores were shared with other work while it ran, so "
            "differences of about 1% are within the noise.\n\n"
            + table
            + "\n\n"
            + "\n".join(f"- {v}" for v in verdicts)
            + "\n\n"
            + cuda
        )
        write_atomic(RESULTS, text)
        print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
