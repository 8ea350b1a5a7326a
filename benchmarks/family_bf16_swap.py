"""Swapping in bf16, for every Hugging Face text family.

Run from the repository root:

    .venv/bin/python benchmarks/family_bf16_swap.py                 # every family
    .venv/bin/python benchmarks/family_bf16_swap.py --quick --out /tmp/s.md   # a few

A user's bf16 loop is ``torch.autocast`` (its weight-cast cache on, the default) around the
forward. For every model type of transformers' auto mappings for causal LMs, masked LMs and
sequence classification (family_padded_recompute.py's tiny configs and padded batches),
that loop trains 3 steps plainly, and again under ``pipeswap.offload(model,
policy="disjoint", footprint_ratio=1.2)``: saved tensors move to host memory and back. A
family is covered when both give the same losses and weights bit for bit and bytes were
swapped (where offload refuses the ratio, at the smallest budget its refusal names, counted
apart). Each row gives the bytes a step did not hold because a repeated cast was kept
once (pipeswap.profiling.cast_twins) and the tensors whose names did not fit the plan
(a layer called more than once a forward).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from _common import RESULTS_DIR, header
from family_coverage import (
    TIME_LIMIT_S,
    reason,
)
from family_padded_recompute import (
    LENGTHS,
    TASKS,
    build,
    family_main,
    loop,
    run,
    task_counts,
)

from pipeswap.config_fields import ConfigError
from pipeswap.training.loop_calls import takes_use_cache
from pipeswap.training.offload import offload

RESULTS = RESULTS_DIR / "family_bf16_swap.md"
RATIO = 1.2
POLICY = "disjoint"
QUICK = ("llama", "gpt2", "bert", "prophetnet", "funnel")


def bf16(inner: Any = None) -> AbstractContextManager[Any]:
    """The user's autocast (cache on), with ``inner`` (offload) inside."""
    stack = ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    if inner is not None:
        stack.enter_context(inner)
    return stack


def check(task: str, model_type: str, auto: Any) -> dict[str, Any]:
    """One family's row."""
    row: dict[str, Any] = {"task": task, "model_type": model_type}
    family = build(task, model_type, auto)
    if family.model is None:
        return {**row, "verdict": family.verdict, "detail": family.detail}
    config, batches, model = family.config, family.batches, family.model
    extra = {"use_cache": False} if takes_use_cache(model.forward, model) else {}
    try:
        plain = loop(model, batches, bf16, extra)
    except Exception as exc:
        return {**row, "verdict": "not run", "detail": f"the plain loop fails: {reason(exc)}"}
    budget: dict[str, Any] = {"footprint_ratio": RATIO}
    verdict, refused = "covered", ""
    for attempt in range(2):
        torch.manual_seed(0)
        model = auto.from_config(config)
        try:
            off = offload(model, policy=POLICY, **budget)
            swapped = loop(model, batches, lambda off=off: bf16(off), {})
            break
        except ConfigError as exc:
            needed = re.search(r"smallest budget that works is (\d+) bytes", str(exc))
            if needed is None or attempt:
                return {**row, "verdict": "fails", "detail": reason(exc)}
            budget = {"gpu_memory": int(needed[1])}
            verdict = f"covered at its smallest budget ({RATIO:g} refused)"
            refused = f"; at {RATIO:g} refused: the smallest is {int(needed[1]) / 2**20:.2f} MiB"
        except Exception as exc:
            return {**row, "verdict": "fails", "detail": reason(exc)}
    stats = off.stats()
    detail = (
        f"{stats['swapped_bytes'] / 2**10:.0f} KiB swapped, {stats['shared_bytes'] / 2**10:.0f}"
        f" KiB of repeated casts kept once, {stats['unmatched_tensors']} tensors unmatched"
        f"{refused}"
    )
    same = plain[0] == swapped[0] and all(
        torch.equal(a, b) for a, b in zip(plain[1], swapped[1], strict=True)
    )
    if not same:
        worst = max((a - b).abs().max().item() for a, b in zip(plain[1], swapped[1], strict=True))
        return {**row, "verdict": "differs", "detail": f"weights by up to {worst:.1e}; {detail}"}
    if not stats["swapped_bytes"]:
        return {**row, "verdict": "nothing swapped", "detail": detail}
    return {**row, "verdict": verdict, "detail": detail}


def render(rows: list[dict[str, Any]], elapsed_s: float, argv: list[str] | None) -> str:
    import transformers

    summary = []
    for task in TASKS:
        mine, ran, at_ratio, at_own = task_counts(rows, task)
        differ = sum(r["verdict"] == "differs" for r in mine)
        covered = at_ratio + at_own
        if mine:
            summary.append(
                f"| {task} | {len(mine)} | {len(ran)} | {at_ratio} | {at_own} | "
                f"{covered}/{len(ran)} | {differ} |"
            )
    padded = ", ".join("/".join(map(str, lengths)) for lengths in LENGTHS)
    lines = [
        f"| task | model types | tiny model ran plainly in bf16 | covered at {RATIO:g} | at "
        f"its smallest budget | covered, of those that ran | differ |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *summary,
        "",
        "| task | model type | swapping in bf16 | detail |",
        "|---|---|---|---|",
        *(f"| {r['task']} | {r['model_type']} | {r['verdict']} | {r['detail']} |" for r in rows),
    ]
    return (
        header("Swapping in bf16, for every Hugging Face text family", "family_bf16_swap.py", argv)
        + f"transformers {transformers.__version__}. The whole run took {elapsed_s:.0f} s "
        f"(at most {TIME_LIMIT_S} s a family).\n\n"
        "Every model type of transformers' auto mappings for causal LMs, masked LMs and "
        "sequence classification, family_coverage.py's tiny config (hidden 32, 2 layers, no "
        "dropout), trains 3 steps (AdamW) on family_padded_recompute.py's padded batches "
        f"(rows of {padded} tokens, each batch padded to its own longest row) in the user's "
        "bf16 loop: `torch.autocast('cpu', dtype=torch.bfloat16)` around the forward, the "
        "autocast cache on as by default, `use_cache=False` where the forward takes it (as "
        "offload passes it). Swapping covers a family when the same loop under "
        f'`pipeswap.offload(model, policy="{POLICY}", footprint_ratio={RATIO:g})` (from the '
        "second step: the first is learnt, timed, to plan) gives its losses and weights bit "
        "for bit and swapped bytes; where offload refuses the ratio, it runs at the "
        "smallest budget the refusal names, counted apart.\n\n"
        "Two things make bf16 bit-identical (docs/concepts.md, Mixed precision and the "
        "memory model): autocast's cache is kept as the user set it and only let go of at "
        "each layer's edge, so a weight a layer uses twice is cast once as in the plain "
        "loop (with the cache off, ProphetNet's weights had differed in their last bits); "
        "and a repeated cast of one activation (an unfused query, key and value projection "
        "reading one normalised input) is kept once, which changes no value. A model that "
        "calls a layer more than once a forward (Dory, HRM) has its casts made again at "
        "each call, a layer's edge: its weights differ in their last bits, and the tensors "
        "of its extra calls do not fit the plan's names (they stay on the device).\n\n"
        "'nothing swapped': the loop was bit-identical, but the plan moved nothing: "
        "offload refused the ratio, and at the smallest budget it named (this tiny model's "
        "embeddings or head weigh far more than its 2 layers' activations) the plan keeps "
        "every tensor; or offload's default layers are not what a text forward calls "
        "(GOT-OCR2's are its vision tower's). 'fails' for ALBERT: one layer's weights "
        "shared across its depth, no list of layers to cut at (offload says so and how to "
        "name them). 'not built' and 'not run': the family's tiny config could not be made "
        "or trained plainly in bf16 on these batches (the detail says why); they say "
        "nothing about pipeswap.\n\n" + "\n".join(lines) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None

    def rows(quick: bool) -> list[dict[str, Any]]:
        return run(quick, check, QUICK, blank={})

    return family_main(argv, __doc__, QUICK, RESULTS, rows, render)


if __name__ == "__main__":
    raise SystemExit(main())
