"""What pipeswap.offload costs in a plain training loop, against the loop alone and save_on_cpu.

Run from the repository root:

    .venv/bin/python benchmarks/offload_cost.py                  # a 4-layer Llama, 40 rounds
    .venv/bin/python benchmarks/offload_cost.py --quick --out /tmp/o.md   # smaller, 6 rounds

One process, one CPU thread, one model built from a local config (no download) per
variant, all from the same seed; each round times one step of every variant in turn, so
the machine's drift touches them alike, and the table gives each variant's median step
(forward, backward, AdamW step) after its first three steps (offload learns a shape on its
first step and plans on its second). Variants: the loop alone; ``offload`` whose plan
moves nothing (a budget above the no-swap peak); ``torch.autograd.graph.save_on_cpu``
(pin_memory=False, as on a machine without a GPU: it copies every tensor autograd saves,
weights included); ``offload`` with the ``save-on-cpu`` policy (every saved activation of
the blocks to host memory); ``offload`` at footprint ratio 1.3 with the ``auto`` policy.
On the CPU a "swap" is a memory copy; the page says what it costs to run pipeswap's
executor (Python hooks per saved tensor) beside PyTorch's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, header
from torch import nn

from pipeswap.jsonio import write_atomic
from pipeswap.training.offload import Offload, offload

RESULTS = RESULTS_DIR / "offload_cost.md"
WARMUP = 3


def llama(hidden: int, layers: int, vocab: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(config)


def saved_bytes(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes save_on_cpu copies in one forward: every tensor autograd saves."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.nbytes
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return total


class Variant:
    """One way to run the loop: its model, optimizer and the context around the forward."""

    def __init__(self, name: str, make: Callable[[nn.Module], Any], build: Callable[[], nn.Module]):
        self.name = name
        self.model = build()
        self.context = make(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.times: list[float] = []

    def around(self) -> AbstractContextManager[Any]:
        if isinstance(self.context, Offload):
            return self.context
        return self.context() if callable(self.context) else nullcontext()

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        started = time.perf_counter()
        with self.around():
            loss = self.model(**batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    torch.set_num_threads(1)
    hidden, layers, seq, batch_size, rounds = (
        (64, 3, 64, 4, 6) if args.quick else (256, 4, 256, 8, args.rounds)
    )
    vocab = 512

    def build() -> nn.Module:
        return llama(hidden, layers, vocab)

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def save_on_cpu(model: nn.Module) -> Callable[[], Any]:
        return lambda: torch.autograd.graph.save_on_cpu(pin_memory=False)

    variants = [
        Variant("the loop alone", lambda m: None, build),
        Variant("offload, nothing to move", lambda m: offload(m, gpu_memory="1TiB"), build),
        Variant("save_on_cpu (PyTorch)", save_on_cpu, build),
        Variant("offload, policy save-on-cpu", lambda m: offload(m, policy="save-on-cpu"), build),
        Variant("offload, ratio 1.3, auto", lambda m: offload(m, footprint_ratio=1.3), build),
    ]
    for variant in variants:
        for _ in range(WARMUP):
            variant.step(batch)
    for _ in range(rounds):
        for variant in variants:
            variant.times.append(variant.step(batch))
    plain = statistics.median(variants[0].times)
    copied = saved_bytes(variants[0].model, batch)
    rows = []
    for variant in variants:
        moved: int | None = 0
        policy = "-"
        if isinstance(variant.context, Offload):
            stats = variant.context.stats()
            moved, policy = stats["swapped_bytes"], stats.get("policy", "-")
        elif variant.name.startswith("save_on_cpu"):
            moved = copied
        median = statistics.median(variant.times)
        low, _, high = statistics.quantiles(variant.times, n=4)
        rows.append(
            {
                "name": variant.name,
                "ms": median * 1e3,
                "spread": (low * 1e3, high * 1e3),
                "ratio": median / plain,
                "moved": moved,
                "policy": policy,
            }
        )
    return rows, rounds


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| variant | plan policy | median step | middle half of the steps | vs the loop alone "
        "| bytes to host per step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['policy']} | {r['ms']:.2f} ms | "
            f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f} ms | {r['ratio']:.3f}x | "
            f"{r['moved'] / 2**20:.2f} MiB |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="a smaller model, 6 rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    args = parser.parse_args(argv)
    rows, rounds = run(args)
    by = {r["name"]: r for r in rows}
    mine, theirs = by["offload, policy save-on-cpu"], by["save_on_cpu (PyTorch)"]
    (plain_low, plain_high), plain_ms = rows[0]["spread"], rows[0]["ms"]
    text = (
        header("pipeswap.offload in your own loop: its cost", "offload_cost.py", argv)
        + (
            f"Median over {rounds} rounds after {WARMUP} warm-up steps, one CPU thread "
            "(see the script's docstring for the setup).\n\n"
        )
        + table(rows)
        + (
            f"\nWith nothing to move, offload's median step is "
            f"{by['offload, nothing to move']['ratio']:.3f}x the loop's (its plan moves "
            "nothing, so no executor runs: a hook on the model's call reads the input's "
            "shapes). Moving every saved activation of the blocks, offload's median step is "
            f"{mine['ratio'] / theirs['ratio']:.3f}x save_on_cpu's ({mine['moved'] / 2**20:.2f} "
            f"MiB against save_on_cpu's {theirs['moved'] / 2**20:.2f} MiB, which counts the "
            "weights and everything outside the blocks too). Read the ratios against the "
            f"spread: the middle half of the loop's own steps spans {plain_low:.1f}-"
            f"{plain_high:.1f} ms around its median of {plain_ms:.1f} ms on this machine.\n"
        )
    )
    print(text)
    write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
