"""A loop that pads each batch to its own longest row: offload against its peers, interleaved.

    .venv/bin/python benchmarks/offload_shapes.py             # CPU: docs/results/offload_shapes.md
    .venv/bin/python benchmarks/offload_shapes.py --device cuda --hidden 1024 --layers 12 \
        --vocab 8192 --low 256 --high 1024 --multiple 8 --ratio 1.12
    .venv/bin/python benchmarks/offload_shapes.py --quick     # a few steps, nothing written

An HF Llama in the user's own loop (AdamW, the model's own loss), its batches padded as
DataCollatorWithPadding pads them, so almost every step has a new length. Every way of
running the loop takes its step in turn (interleaved, one run: the machine's noise falls on
all alike); a second pass runs the same steps again under the device's meter (CUDA's
allocator; on the CPU the live storages, pipeswap's host pool left out) for each step's peak,
one way at a time with only its own model built (CUDA's allocator counts the whole process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import RESULTS_DIR, header  # noqa: E402
from pipeswap.profiling.meter import DeviceMeter  # noqa: E402
from pipeswap.training.loop_shapes import describe  # noqa: E402
from pipeswap.training.offload import Offload, offload  # noqa: E402

MiB = 2**20


@dataclass
class Way:
    """One way of running the loop: its model, optimizer and what wraps each forward."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    wrap: Callable[[], AbstractContextManager[Any]]
    off: Offload | None = None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        max_position_embeddings=max(2048, args.high),
        use_cache=False,  # as offload and HF checkpointing run it
    )
    with device:
        return transformers.LlamaForCausalLM(config)


def padded_batches(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(args.steps):
        lengths = torch.randint(args.low, args.high + 1, (args.batch,), generator=generator)
        longest = -(-int(lengths.max()) // args.multiple) * args.multiple  # pad_to_multiple_of
        ids = torch.zeros(args.batch, longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, length in enumerate(lengths.tolist()):
            ids[row, :length] = torch.randint(1, args.vocab, (length,), generator=generator)
            mask[row, :length] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append(
            {
                "input_ids": ids.to(device),
                "attention_mask": mask.to(device),
                "labels": labels.to(device),
            }
        )
    return out


WAYS = ("plain", "HF checkpointing", "save_on_cpu", "offload + plan_for", "offload")


def ways(
    args: argparse.Namespace,
    device: torch.device,
    longest: dict[str, Any],
    names: Sequence[str] = WAYS,
) -> list[Way]:
    out = []
    for name in names:
        model = build(args, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        wrap: Callable[[], AbstractContextManager[Any]] = nullcontext
        off = None
        if name == "HF checkpointing":
            model.gradient_checkpointing_enable({"use_reentrant": False})
        elif name == "save_on_cpu":
            wrap = _on_cpu(pin=device.type == "cuda")
        elif name.startswith("offload"):
            off = offload(model, footprint_ratio=args.ratio, optimizer=optimizer)
            if name == "offload + plan_for":
                off.plan_for(**longest)
            wrap = _always(off)
        out.append(Way(name, model, optimizer, wrap, off))
    return out


def _on_cpu(*, pin: bool) -> Callable[[], AbstractContextManager[Any]]:
    return lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)


def _always(context: AbstractContextManager[Any]) -> Callable[[], AbstractContextManager[Any]]:
    return lambda: context


def step(way: Way, batch: dict[str, Any], device: torch.device, meter: bool) -> None:
    pools = way.off.host_pools() if way.off is not None else []
    metering = (
        DeviceMeter(device, holding=(way.model, way.optimizer, batch), exclude=pools)
        if meter
        else nullcontext()
    )
    if meter and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    started = time.perf_counter()
    with metering as reading:
        with way.wrap():
            loss = way.model(**batch).loss
        loss.backward()
        way.optimizer.step()
        way.optimizer.zero_grad(set_to_none=True)
        _sync(device)
    if meter:
        assert isinstance(reading, DeviceMeter)
        way.peaks.append(reading.peak)
    else:
        way.times.append(time.perf_counter() - started)
        way.losses.append(loss.item())


def _summary(way: Way) -> dict[str, Any]:
    """What the page needs of a way's offload, kept before its model goes."""
    if way.off is None:
        return {}
    plans = [
        (describe(sig), planned.planning_s, planned.derived_from)
        for sig, planned in way.off.shapes.plans.items()
    ]
    return {**way.off.stats(), "plans_made": plans}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--low", type=int, default=16)
    parser.add_argument("--high", type=int, default=192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ratio", type=float, default=1.5)
    parser.add_argument(
        "--multiple", type=int, default=1, help="pad each batch to a multiple of this (CUDA: 8)"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--ways",
        default=",".join(WAYS),
        help="which ways to run, comma-separated (the GPU's memory may not hold one model per way)",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.ways.split(",")) - set(WAYS))
    if unknown or "plain" not in args.ways.split(","):
        parser.error(
            f"--ways: {', '.join(unknown) or 'plain missing'}; choose among {', '.join(WAYS)}, "
            "plain among them (every other way is compared with it)"
        )
    chosen = [w for w in WAYS if w in args.ways.split(",")]
    if args.quick:
        args.steps = 8
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore")
    data = padded_batches(args, device)
    longest = max(data, key=lambda batch: batch["input_ids"].shape[1])
    timed = ways(args, device, longest, chosen)
    for batch in data:  # interleaved: each way takes the same step in turn
        for way in timed:
            step(way, batch, device, meter=False)
    measured = [_summary(way) for way in timed]
    for way in timed:  # what the timed pass built goes before the metered one
        way.model = way.optimizer = way.off = None  # type: ignore[assignment]
    # One way at a time: CUDA's allocator counts every tensor of the process, so each
    # way's steps are metered with only its own model built.
    metered = []
    for name in chosen:
        (way,) = ways(args, device, longest, [name])
        for batch in data:
            step(way, batch, device, meter=True)
        metered.append(Way(name, None, None, nullcontext, peaks=way.peaks))  # type: ignore[arg-type]
        del way
        if device.type == "cuda":
            torch.cuda.empty_cache()
    page = render(args, data, timed, measured, metered, argv)
    print(page)
    if not args.quick:
        name = "offload_shapes.md" if device.type == "cpu" else "offload_shapes_cuda.md"
        (RESULTS_DIR / name).write_text(page)
    return 0


def render(
    args: argparse.Namespace,
    data: list[dict[str, Any]],
    timed: list[Way],
    measured: list[dict[str, Any]],
    metered: list[Way],
    argv: Sequence[str] | None,
) -> str:
    lengths = sorted({batch["input_ids"].shape[1] for batch in data})
    plain = statistics.median(timed[0].times)
    rows = []
    for way, stats, metered_way in zip(timed, measured, metered, strict=True):
        median = statistics.median(way.times)
        budget = stats.get("budget_bytes")
        peak = max(metered_way.peaks)
        over = "-" if budget is None else f"{peak / budget:.3f}"
        # After the first step: the first shape is learnt running as it is (and on the
        # CPU its memory read by a step run aside at the second step's forward).
        later = "-" if budget is None else f"{max(metered_way.peaks[2:]) / budget:.3f}"
        diff = max(abs(a - b) for a, b in zip(way.losses, timed[0].losses, strict=True))
        rows.append(
            [
                way.name,
                f"{median * 1e3:.1f}",
                f"{median / plain:.2f}",
                f"{peak / MiB:.1f}",
                "-" if budget is None else f"{budget / MiB:.1f}",
                over,
                later,
                "-" if not stats else str(stats["learning_steps"]),
                "-" if not stats else f"{stats['total_planning_s']:.2f}",
                "bit-identical" if diff == 0 else f"max diff {diff:.1e}",
            ]
        )
    total = sum(timed[0].times)
    lines = [
        header("Batches of every length: offload against its peers", "offload_shapes.py", argv),
        f"HF Llama (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}), AdamW, "
        f"{args.steps} batches of {args.batch} rows padded to their own longest row "
        f"({len(lengths)} distinct lengths, {lengths[0]}..{lengths[-1]}); offload at a "
        f"footprint ratio of {args.ratio} (one budget for the run). Step time is the median "
        "of the interleaved pass; the peak is the most any step held in the metered pass "
        "('from step 3': of the steps after the first shape was learnt and, on the CPU, its "
        "memory read by a step run aside at the second step). 'learnt' counts steps that "
        "ran with no plan (the first shape, timed to learn it with its saved tensors on "
        "the host, within a plan's memory; every later shape no plan covers is planned "
        "before its forward, derived from the shapes measured); "
        "'planning s' includes plan_for's step run aside.\n",
        "| way | median step ms | x plain | peak MiB | budget MiB | peak / budget | "
        "from step 3 | learnt steps | planning s | losses vs plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        f"The plain loop took {total:.1f} s in all.\n",
        "Planning time per planned shape (the plan serves every smaller batch; 'derived "
        "from': planned before its first step from the shapes measured, '-': measured):\n",
        "| way | shape | planning s | derived from |",
        "|---|---|---:|---|",
    ]
    for way, stats in zip(timed, measured, strict=True):
        for shape, planning_s, derived in stats.get("plans_made", []):
            lines.append(f"| {way.name} | {shape} | {planning_s:.3f} | {derived or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
