"""Every plan against the device's own meter: budget vs predicted vs measured peak.

    .venv/bin/python benchmarks/memory_truth.py                 # CPU: docs/results/memory_truth.md
    .venv/bin/python benchmarks/memory_truth.py --device cuda   # -> docs/results/memory_truth_cuda.md
    .venv/bin/python benchmarks/memory_truth.py --quick         # a few rows, nothing written

A user's own loop (the model's own loss, the user's optimizer, ``pipeswap.offload`` around the
forward), Hugging Face models built from configs. The meter is not pipeswap's: on CUDA
``torch.cuda.max_memory_allocated`` over each step (reset at its start); on the CPU the live
storages of each step, as torch's MemTracker counts them
(pipeswap.profiling.meter.StorageMeter, checked equal to MemTracker in its tests), with
pipeswap's host pool left out. "measured" is the most any step after the plan held;
"predicted" the plan's own peak; "no-swap" rows compare the planner's no-swap peak with
what a plan that keeps everything measured, and with the plain loop's measured peak
(pipeswap keeps a repeated cast once, so under autocast it holds less); "HF checkpointing" is ``gradient_checkpointing_enable()``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import RESULTS_DIR, header  # noqa: E402
from pipeswap.profiling.meter import DeviceMeter  # noqa: E402
from pipeswap.training.offload import offload  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class Model:
    """A Hugging Face model to build from a config, with its batches."""

    name: str
    family: str  # llama | gpt2 | bert | vit
    hidden: int
    layers: int
    vocab: int
    batch: int
    seq: int

    def build(self, device: torch.device) -> torch.nn.Module:

        torch.manual_seed(0)
        with device:  # initialised where it trains: a 1 B model builds in seconds on a GPU
            return self._build()

    def _build(self) -> torch.nn.Module:
        import transformers as hf

        heads = max(1, self.hidden // 64)
        if self.family == "llama":
            config: Any = hf.LlamaConfig(
                vocab_size=self.vocab,
                hidden_size=self.hidden,
                intermediate_size=int(self.hidden * 2.6875) // 64 * 64,
                num_hidden_layers=self.layers,
                num_attention_heads=heads,
                num_key_value_heads=heads,
                max_position_embeddings=self.seq,
                attn_implementation="sdpa",
            )
            model: Any = hf.LlamaForCausalLM(config)
        elif self.family == "gpt2":
            config = hf.GPT2Config(
                vocab_size=self.vocab,
                n_embd=self.hidden,
                n_layer=self.layers,
                n_head=heads,
                n_positions=self.seq,
                tie_word_embeddings=True,
                attn_implementation="sdpa",
            )
            model = hf.GPT2LMHeadModel(config)
        elif self.family == "bert":
            config = hf.BertConfig(
                vocab_size=self.vocab,
                hidden_size=self.hidden,
                num_hidden_layers=self.layers,
                num_attention_heads=heads,
                intermediate_size=self.hidden * 4,
                max_position_embeddings=self.seq,
                attn_implementation="sdpa",
            )
            model = hf.BertForMaskedLM(config)
        else:
            config = hf.ViTConfig(
                hidden_size=self.hidden,
                num_hidden_layers=self.layers,
                num_attention_heads=heads,
                intermediate_size=self.hidden * 4,
                image_size=self.seq,
                patch_size=8,
                num_labels=10,
                attn_implementation="sdpa",
            )
            model = hf.ViTForImageClassification(config)
        model.train()
        return model

    def batches(self, steps: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(steps):
            if self.family == "vit":
                pixels = torch.randn(self.batch, 3, self.seq, self.seq, generator=g)
                labels = torch.randint(0, 10, (self.batch,), generator=g)
                out.append({"pixel_values": pixels.to(device), "labels": labels.to(device)})
            else:
                ids = torch.randint(0, self.vocab, (self.batch, self.seq), generator=g).to(device)
                out.append({"input_ids": ids, "labels": ids})
        return out


@dataclass
class Run:
    """One loop: its losses, final weights, each step's measured peak and offload's stats."""

    losses: list[float]
    weights: list[torch.Tensor]
    peaks: list[int]
    step_s: list[float]
    stats: dict[str, Any]


def isolated_loop(spec: Model, device: torch.device, **loop: Any) -> Run:
    """:func:`user_loop` (``loop``: its keyword arguments), on CUDA in a process of its own
    (as a user runs one job): what a previous case left in the allocator cannot count
    against the next. Weights do not come back from a child (CUDA losses are compared)."""
    if device.type != "cuda":
        return user_loop(spec, device, **loop)
    case = {"model": asdict(spec), "device": str(device), "loop": loop}
    done = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(case)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1])
    found = json.loads(lines[-1])
    return Run(found["losses"], [], found["peaks"], found["step_s"], found["stats"])


def _one_case(text: str) -> int:
    """The child of :func:`isolated_loop`: one loop, its Run as one JSON line."""
    case = json.loads(text)
    run = user_loop(Model(**case["model"]), torch.device(case["device"]), **case["loop"])
    found = {"losses": run.losses, "peaks": run.peaks, "step_s": run.step_s, "stats": run.stats}
    print(json.dumps(found, default=str))
    return 0


def user_loop(
    spec: Model,
    device: torch.device,
    *,
    steps: int,
    precision: str,
    optimizer: str,
    settings: dict[str, Any] | None = None,
    checkpointing: bool = False,
    torch_save_on_cpu: bool = False,
    keep_outputs: bool = False,
) -> Run:
    """The user's own loop, each step under the device's meter; ``settings`` for offload.
    ``keep_outputs``: the loop holds the model's outputs through the backward
    (``outputs = model(...); loss = outputs.loss``), not only the loss."""
    model = spec.build(device)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(model.parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=1e-4)
        if optimizer == "adamw"
        else torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    )
    off = None if settings is None else offload(model, optimizer=opt, **settings)
    cast = torch.bfloat16 if precision == "bf16-mixed" else None
    losses, peaks, times = [], [], []
    wrap: Callable[[], AbstractContextManager[Any]] = nullcontext
    if off is not None:
        wrap = _always(off)
    elif torch_save_on_cpu:

        def wrap() -> AbstractContextManager[Any]:
            return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")

    data = spec.batches(steps, device)
    while data:  # each batch let go of once the next is taken, as from a DataLoader
        batch = data.pop(0)
        pools = [] if off is None else off.host_pools()
        meter = DeviceMeter(device, holding=(model, opt, batch), exclude=pools)
        _sync(device)
        started = time.perf_counter()
        with meter:
            with torch.autocast(device.type, dtype=cast or torch.float32, enabled=cast is not None):
                with wrap():
                    kwargs = {} if off is not None or spec.family == "vit" else {"use_cache": False}
                    outputs = model(**batch, **kwargs)
                    loss = outputs.loss
                    if not keep_outputs:
                        del outputs
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
        times.append(time.perf_counter() - started)
        losses.append(loss.item())
        peaks.append(meter.peak)
    stats = {} if off is None else off.stats()
    weights = [p.detach().cpu().clone() for p in model.parameters()]
    del model, opt, off
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Run(losses, weights, peaks, times, stats)


def _always(context: AbstractContextManager[Any]) -> Callable[[], AbstractContextManager[Any]]:
    return lambda: context


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _same(a: Run, b: Run) -> str:
    if a.losses == b.losses and all(torch.equal(x, y) for x, y in zip(a.weights, b.weights)):
        return "bit-identical"
    worst = max(abs(x - y) for x, y in zip(a.losses, b.losses))
    return f"loss within {worst:.1e}"


CPU_MODELS = [
    Model("llama-v32000", "llama", 128, 4, 32000, 4, 128),
    Model("llama-h256", "llama", 256, 8, 512, 4, 256),
    Model("gpt2-tied", "gpt2", 128, 4, 2048, 4, 128),
    Model("bert", "bert", 128, 4, 2048, 4, 128),
    Model("vit", "vit", 128, 4, 0, 8, 64),
]
CUDA_MODELS = [Model("llama-0.94B", "llama", 2048, 16, 32000, 8, 2048)]
POLICIES = [
    ("recompute", 1.5),
    ("disjoint", 1.5),
    ("bidirectional", 1.5),
    ("save-on-cpu", 1.5),
    ("auto", 1.5),
    ("hybrid", 1.25),
    ("hybrid", 1.5),
    ("hybrid", 2.0),
]


def rows_for(
    spec: Model, device: torch.device, precision: str, optimizer: str, steps: int, quick: bool
) -> list[list[str]]:
    """The rows of one model: plain, HF checkpointing, each policy, and the smallest budget."""
    rows = []
    plain = isolated_loop(spec, device, steps=steps, precision=precision, optimizer=optimizer)
    plain_peak = max(plain.peaks[2:])
    label = f"{spec.name} {precision} {optimizer}"
    rows.append([label, "plain", "-", "-", "-", _mib(plain_peak), "-", "-", _ms(plain)])
    ckpt = isolated_loop(
        spec, device, steps=steps, precision=precision, optimizer=optimizer, checkpointing=True
    )
    ckpt_peak = max(ckpt.peaks[2:])
    rows.append([label, "HF checkpointing", "-", "-", "-", _mib(ckpt_peak), "-", "-", _ms(ckpt)])
    cases = POLICIES[:2] if quick else POLICIES
    if device.type == "cuda":  # every saved tensor pinned on the host: too much for one run
        cases = [case for case in cases if case[0] != "save-on-cpu"]
    for policy, ratio in cases:
        settings = {"footprint_ratio": ratio, "policy": policy}
        rows.append(_case(spec, device, precision, optimizer, steps, settings, plain, f"{ratio}"))
    run = isolated_loop(  # a budget nothing needs: the planner's view of the model, unswapped
        spec,
        device,
        steps=steps,
        precision=precision,
        optimizer=optimizer,
        settings={"gpu_memory": 2**50, "policy": "hybrid"},
    )
    least = run.stats.get("smallest_budget_bytes")
    no_swap = run.stats.get("no_swap_peak_bytes")
    if no_swap:
        kept = max(run.peaks[2:], default=0)  # what the plan that keeps everything held
        shared = run.stats.get("shared_bytes", 0)
        rows.append(
            [
                label,
                "no-swap peak",
                "-",
                "-",
                _mib(no_swap),
                _mib(kept) if kept else "-",
                "-",
                f"{(no_swap / plain_peak - 1) * 100:+.1f}% vs plain's {_mib(plain_peak)} "
                f"({_mib(shared)} MiB of repeated casts kept once)",
                "-",
            ]
        )
    if least:
        settings = {"gpu_memory": int(least), "policy": "hybrid"}
        rows.append(_case(spec, device, precision, optimizer, steps, settings, plain, "smallest"))
        rows[-1][7] += f"; smallest {_mib(least)} vs HF checkpointing {_mib(ckpt_peak)}"
    return rows


def _case(
    spec: Model,
    device: torch.device,
    precision: str,
    optimizer: str,
    steps: int,
    settings: dict[str, Any],
    plain: Run,
    ratio: str,
) -> list[str]:
    label = f"{spec.name} {precision} {optimizer}"
    policy = settings["policy"]
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            run = isolated_loop(
                spec,
                device,
                steps=steps,
                precision=precision,
                optimizer=optimizer,
                settings=settings,
            )
    except Exception as exc:  # noqa: BLE001 - a refusal is a row too
        text = str(exc).splitlines()[0][:140]
        return [label, f"offload {policy}", ratio, "refused", "-", "-", "-", text, "-"]
    budget = run.stats["budget_bytes"]
    measured = max(run.peaks[3:] if len(run.peaks) > 3 else run.peaks[2:])
    replans = run.stats.get("replans", 0)
    note = _same(plain, run) if device.type == "cpu" else _close(plain, run)
    if replans or seen:
        note += f"; planned again {replans}x"
    return [
        label,
        f"offload {policy}",
        ratio,
        _mib(budget),
        _mib(run.stats["predicted_peak_bytes"]),
        _mib(measured),
        f"{measured / budget:.3f}",
        note,
        _ms(run),
    ]


def _close(a: Run, b: Run) -> str:
    worst = max(abs(x - y) for x, y in zip(a.losses, b.losses))
    return f"loss within {worst:.1e}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f}"


def _ms(run: Run) -> str:
    return f"{statistics.median(run.step_s[3:] or run.step_s) * 1e3:.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="two models, two policies, no file")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="the page to write (default by device)")
    parser.add_argument(
        "--settings",
        default="bf16-mixed:adamw,fp32:sgd",
        help="precision:optimizer pairs, comma-separated",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one isolated loop (a child)
    args = parser.parse_args(argv)
    if args.case:
        return _one_case(args.case)
    device = torch.device(args.device)
    models = CUDA_MODELS if device.type == "cuda" else CPU_MODELS
    settings = [tuple(pair.split(":", 1)) for pair in args.settings.split(",")]
    if args.quick:
        models, settings = models[:1], settings[:1]
    rows: list[list[str]] = []
    for spec in models:
        for precision, optimizer in settings:
            rows.extend(rows_for(spec, device, precision, optimizer, args.steps, args.quick))
            print(_table(rows[-1:]), flush=True)
    table = _table(rows)
    print(table)
    over = [r for r in rows if r[6] not in ("-",) and float(r[6]) > 1.02]
    summary = (
        f"{sum(1 for r in rows if r[6] != '-')} planned runs; measured peak over budget x 1.02: "
        f"{len(over)}\n"
    )
    print(summary)
    if args.quick:
        return 0
    name = "memory_truth_cuda.md" if device.type == "cuda" else "memory_truth.md"
    page = Path(args.out) if args.out else RESULTS_DIR / name
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    page.write_text(
        header(f"Memory truth ({card}): budget vs predicted vs measured", "memory_truth.py", argv)
        + (__doc__ or "").split("\n\n", 2)[2]
        + "\n"
        + summary
        + "\n"
        + table
        + "\n"
    )
    print(f"written to {page}")
    return 0


def _table(rows: list[list[str]]) -> str:
    head = [
        "model",
        "run",
        "ratio",
        "budget MiB",
        "predicted MiB",
        "measured MiB",
        "measured/budget",
        "vs plain",
        "step ms",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
