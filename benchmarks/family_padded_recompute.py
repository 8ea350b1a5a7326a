"""Recomputation on padded batches, for every Hugging Face text family.

Run from the repository root:

    .venv/bin/python benchmarks/family_padded_recompute.py                 # every family
    .venv/bin/python benchmarks/family_padded_recompute.py --quick --out /tmp/r.md   # a few

For every model type of transformers' auto mappings for causal LMs, masked LMs and
sequence classification (family_coverage.py's tiny configs and model lists; image
classification has no attention mask, so it is left out), the model is built with its
family's own default ``use_cache`` and trained 3 steps on batches padded as
DataCollatorWithPadding pads them: each batch padded (on the right) to its own longest
row, at least one row padded, the padding masked out of the attention (zeros in
attention_mask) and of the loss (labels -100), the longest row changing from batch to
batch. The plain loop passes ``use_cache=False`` where the model's forward takes it, as
offload does; the same loop under ``pipeswap.offload(model, policy="recompute",
footprint_ratio=1.2)`` re-runs every layer in the backward. A family is covered when both
give the same losses and weights bit for bit and layers were recomputed (where offload
refuses the ratio as more than recomputing can free, at the smallest budget its refusal
names, counted apart). A call that asks for the key-value cache (``use_cache=True``, or a
cache object as ``cache``, ``past_key_values`` before transformers 5) is then made under
offload: it must be refused before its forward, with a message naming it.
"""

from __future__ import annotations

import argparse
import re
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch
from _common import RESULTS_DIR, header
from family_coverage import (
    MAPPINGS,
    TIME_LIMIT_S,
    VOCAB,
    model_types,
    reason,
    tiny_config,
    too_large,
    too_long,
)
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import write_atomic
from pipeswap.training.loop_calls import takes_use_cache
from pipeswap.training.offload import offload

RESULTS = RESULTS_DIR / "family_padded_recompute.md"
TASKS = ("causal LM", "masked LM", "sequence classification")  # the ones with a mask
# Each batch's row lengths (tokens before the padding): every batch has padded rows and its
# own longest row, within the tiny configs' 64 positions. Rows this long let recomputation
# keep the 1.2 ratio's budget: at 16 tokens the logits and the optimizer's state outweigh
# what recomputing the 2 layers frees (a Llama's plan then needs a larger budget).
LENGTHS = ((60, 41, 23, 50), (37, 52, 52, 20), (28, 47, 39, 44))
QUICK = ("llama", "gpt2", "bert", "granitemoe", "funnel", "ctrl")
RATIO = 1.2  # footprint_ratio: recompute's plan must keep 1/1.2 of the no-swap peak


def padded_batches(task: str, config: Any) -> list[dict[str, torch.Tensor]]:
    """LENGTHS' batches as DataCollatorWithPadding makes them of tokenized texts: each row
    closed by the family's end-of-sequence token (where it has one, other than its pad
    token: BART's classifier pools there), right-padded with its pad token to the batch's
    longest row, attention_mask 0 on the padding, labels -100 there (a token model's labels
    are its inputs; a classifier's are one class a row)."""
    pad = _token(config, "pad_token_id") or 0
    eos = _token(config, "eos_token_id")
    eos = None if eos == pad else eos
    ordinary = torch.tensor([t for t in range(3, VOCAB) if t not in (pad, eos)])
    generator = torch.Generator().manual_seed(7)
    batches = []
    for lengths in LENGTHS:
        longest = max(lengths)
        ids = torch.full((len(lengths), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, length in enumerate(lengths):
            tokens = ordinary[torch.randint(len(ordinary), (length,), generator=generator)]
            if eos is not None:
                tokens[-1] = eos
            ids[row, :length] = tokens
            mask[row, :length] = 1
        if task == "sequence classification":
            labels = torch.randint(0, 3, (len(lengths),), generator=generator)
        else:
            labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def _token(config: Any, name: str) -> int | None:
    """The family's special token ``name`` within the tiny vocabulary (the first of a list;
    its text config's where it has one), or None."""
    for each in (config, getattr(config, "text_config", None)):
        token = getattr(each, name, None)
        token = token[0] if isinstance(token, list) and token else token
        if isinstance(token, int) and 0 <= token < VOCAB:
            return token
    return None


def default_cache(config: Any) -> str:
    """The family's default use_cache (its text config's where it has one), for the table."""
    for each in (getattr(config, "text_config", None), config):
        value = getattr(each, "use_cache", None)
        if isinstance(value, bool):
            return "on" if value else "off"
    return "-"


def loop(
    model: nn.Module,
    batches: list[dict[str, torch.Tensor]],
    around: Callable[[], AbstractContextManager[Any]],
    extra: dict[str, Any],
) -> tuple[list[float], list[torch.Tensor]]:
    """3 steps of the user's loop (AdamW, the model's loss), each forward inside around()
    with ``extra`` keyword arguments: (losses, weights)."""
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in batches:
        with around():
            loss = model(**batch, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


class Family(NamedTuple):
    """A family's tiny model (its own default use_cache) and padded batches, or why not:
    ``verdict`` 'not built' or 'not run' and its ``detail``."""

    config: Any = None
    batches: list[dict[str, torch.Tensor]] = []
    model: nn.Module | None = None
    verdict: str = ""
    detail: str = ""


def build(task: str, model_type: str, auto: Any) -> Family:
    try:
        config = tiny_config(model_type, use_cache=None)  # the family's own default
    except Exception as exc:
        return Family(verdict="not built", detail=reason(exc))
    try:
        large = too_large(auto, config)
        if large is not None:
            return Family(config, verdict="not run", detail=large)
        batches = padded_batches(task, config)
        torch.manual_seed(0)
        return Family(config, batches, auto.from_config(config))
    except Exception as exc:
        return Family(config, verdict="not built", detail=reason(exc))


def check(task: str, model_type: str, auto: Any) -> dict[str, Any]:
    """One family's row: verdict, detail, default cache, refusal (the verdict says whether
    the plain loop ran)."""
    row: dict[str, Any] = {"task": task, "model_type": model_type, "cache": "-", "refusal": "-"}
    family = build(task, model_type, auto)
    if family.config is not None:
        row["cache"] = default_cache(family.config)
    if family.model is None:
        return {**row, "verdict": family.verdict, "detail": family.detail}
    config, batches, model = family.config, family.batches, family.model
    takes = takes_use_cache(model.forward, model)  # as offload decides
    try:
        plain = loop(model, batches, nullcontext, {"use_cache": False} if takes else {})
    except Exception as exc:
        return {**row, "verdict": "not run", "detail": f"the plain loop fails: {reason(exc)}"}
    if takes:
        row["refusal"] = "not checked: offload did not run"
    budget: dict[str, Any] = {"footprint_ratio": RATIO}
    verdict, refused = "covered", ""
    try:
        model, off, recomputed = recompute(auto, config, batches, budget)
    except ConfigError as exc:
        needed = re.search(r"smallest budget that works is (\d+) bytes", str(exc))
        if needed is None:
            return {**row, "verdict": "fails", "detail": reason(exc)}
        # An honest refusal, not a wrong result: recomputing every layer frees less than
        # the ratio asks of this model. Recompute then runs at the budget its plan names.
        budget = {"gpu_memory": int(needed[1])}
        verdict = f"covered at its smallest budget ({RATIO:g} refused)"
        refused = f"; at {RATIO:g} refused: the smallest budget is {_mib(int(needed[1]))}"
        try:
            model, off, recomputed = recompute(auto, config, batches, budget)
        except Exception as again:
            return {**row, "verdict": "fails", "detail": reason(again)}
    except Exception as exc:
        return {**row, "verdict": "fails", "detail": reason(exc)}
    stats = off.stats()
    if takes:
        row["refusal"] = refusal(model, off, batches[0], config)
    same = plain[0] == recomputed[0] and all(
        torch.equal(a, b) for a, b in zip(plain[1], recomputed[1], strict=True)
    )
    if not same:
        worst = max(abs(a - b) for a, b in zip(plain[0], recomputed[0], strict=True))
        detail = f"losses or weights differ from the plain loop (losses by up to {worst:.1e})"
        return {**row, "verdict": "differs", "detail": detail}
    if not stats["recomputed_layers"]:
        calls = layer_calls(model, off, batches[0])
        detail = (
            f"the plan re-ran no layer: a forward calls its {len(off.layer_names)} layers "
            f"({off.layer_names[0]}, ...) {calls} times"
        )
        return {**row, "verdict": "nothing recomputed", "detail": detail}
    layers = f"{stats['recomputed_layers']} of {len(off.layer_names)} layers re-run"
    detail = f"{layers}; {off.layer_names[0]}, ...{refused}"
    return {**row, "verdict": verdict, "detail": detail}


def recompute(
    auto: Any, config: Any, batches: list[dict[str, torch.Tensor]], budget: dict[str, Any]
) -> tuple[nn.Module, Any, tuple[list[float], list[torch.Tensor]]]:
    """The family's model, built as the plain loop's, trained by the loop under
    ``offload(model, policy="recompute", **budget)``: (model, offload, (losses, weights))."""
    torch.manual_seed(0)
    model = auto.from_config(config)
    off = offload(model, policy="recompute", **budget)
    return model, off, loop(model, batches, lambda: off, {})


def layer_calls(model: nn.Module, off: Any, batch: dict[str, torch.Tensor]) -> int:
    """How many times a forward of the batch (no gradients) calls offload's layers."""
    calls: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in off.layers.values()]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    return len(calls)


def _mib(size: int) -> str:
    return f"{size / 2**20:.2f} MiB"


def refusal(model: nn.Module, off: Any, batch: dict[str, torch.Tensor], config: Any) -> str:
    """Whether offload refuses calls that ask for a key-value cache before their forward (no
    layer called): 'refused: ...', or what happened instead."""
    asks: list[tuple[str, dict[str, Any]]] = [("use_cache=True", {"use_cache": True})]
    # transformers 5 names the key-value cache `cache` (`past_key_values` before).
    takes = _parameters(model.forward) & {"cache", "past_key_values"}
    if takes:
        import transformers

        name = min(takes)  # `cache` where the forward takes both
        asks.append((name, {name: transformers.DynamicCache(config=config)}))
    called: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda *_: called.append(1)) for m in off.layers.values()]
    try:
        for name, extra in asks:
            try:
                with off:
                    model(**batch, **extra).loss.backward()
            except PipeswapError as exc:
                if name not in str(exc):
                    return f"{name}: refused, not naming it: {reason(exc)}"
            except Exception as exc:
                return f"{name}: not refused, the model raised {reason(exc)}"
            else:
                return f"{name}: not refused, the step ran"
            if called:
                return f"{name}: refused after the layers ran"
    finally:
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
    return "refused: " + ", ".join(name for name, _ in asks)


def _parameters(forward: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return set()


def run(
    quick: bool,
    check_one: Callable[[str, str, Any], dict[str, Any]] = check,
    quick_names: tuple[str, ...] = QUICK,
    blank: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """``check_one`` for every family of every task (``quick``: ``quick_names`` only), each
    within the time limit; ``blank``: a timed-out row's other cells."""
    import transformers

    blank = {"cache": "-", "refusal": "-"} if blank is None else blank
    rows = []
    for task in TASKS:
        mapping, auto_name = MAPPINGS[task]
        auto = getattr(transformers, auto_name)
        names = [n for n in model_types(mapping) if not quick or n in quick_names]
        for model_type in names:
            started = time.perf_counter()
            signal.alarm(TIME_LIMIT_S)
            try:
                row = check_one(task, model_type, auto)
            except TimeoutError:
                row = {"task": task, "model_type": model_type, **blank}
                row |= {"verdict": "not run", "detail": f"took more than {TIME_LIMIT_S} s"}
            finally:
                signal.alarm(0)
            row["wall_s"] = time.perf_counter() - started
            rows.append(row)
            print(row, flush=True)
    return rows


class TaskCounts(NamedTuple):
    """A task's rows: all, those whose tiny model ran, and how many were covered at the
    ratio and at their smallest budget."""

    mine: list[dict[str, Any]]
    ran: list[dict[str, Any]]
    at_ratio: int
    at_own: int


def task_counts(rows: list[dict[str, Any]], task: str) -> TaskCounts:
    mine = [r for r in rows if r["task"] == task]
    return TaskCounts(
        mine,
        [r for r in mine if r["verdict"] not in ("not built", "not run")],
        sum(r["verdict"] == "covered" for r in mine),
        sum(r["verdict"].startswith("covered at") for r in mine),
    )


def render(rows: list[dict[str, Any]], elapsed_s: float, argv: list[str] | None) -> str:
    import transformers

    summary = []
    for task in TASKS:
        mine, ran, at_ratio, at_own = task_counts(rows, task)
        covered = at_ratio + at_own
        asked = [r for r in ran if r["refusal"] != "-"]
        refused = sum(r["refusal"].startswith("refused:") for r in asked)
        if mine:
            summary.append(
                f"| {task} | {len(mine)} | {len(ran)} | {at_ratio} | {at_own} | "
                f"{covered} ({covered / len(mine):.0%}) | {covered}/{len(ran)} | "
                f"{refused}/{len(asked)} |"
            )
    lines = [
        f"| task | model types | tiny model ran plainly | recompute covers at {RATIO:g} | at its "
        f"smallest budget ({RATIO:g} refused) | covered | of those that ran | cache calls "
        "refused (of those that ran whose forward takes use_cache) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *summary,
        "",
        "| task | model type | default use_cache | recompute | detail | a call asking for the "
        "cache |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['task']} | {r['model_type']} | {r['cache']} | {r['verdict']} | {r['detail']} | "
        f"{r['refusal']} |"
        for r in rows
    ]
    padded = ", ".join("/".join(map(str, lengths)) for lengths in LENGTHS)
    return (
        header(
            "Recomputation on padded batches, for every Hugging Face text family",
            "family_padded_recompute.py",
            argv,
        )
        + f"transformers {transformers.__version__}. The whole run took {elapsed_s:.0f} s "
        f"(at most {TIME_LIMIT_S} s a family).\n\n"
        "Every model type of transformers' auto mappings for causal LMs, masked LMs and "
        "sequence classification, built from family_coverage.py's tiny config (hidden 32, 2 "
        "layers, no dropout) but with the family's own default `use_cache` (column 3: on "
        "means a plain forward builds a key-value cache unless told not to), trains 3 steps "
        "(AdamW) on batches padded as DataCollatorWithPadding pads them: rows of "
        f"{padded} tokens (random ones, the last the family's end-of-sequence token where it "
        "has one other than its pad token, as a tokenizer closes a text), each batch padded "
        "on the right to its own longest row with the family's pad token, attention_mask 0 "
        "and labels -100 on the padding (a "
        "classifier's labels are one class a row). Image classification is left out: its "
        "batches have no attention mask to pad.\n\n"
        "Recompute covers a family when the loop under "
        f'`pipeswap.offload(model, policy="recompute", footprint_ratio={RATIO:g})` (every '
        "layer re-run in the backward, from the second step: the first is learnt, timed, "
        "to plan) gives the plain loop's losses and weights bit for bit, and layers were "
        f"recomputed. Where offload refuses the ratio {RATIO:g} (recomputing every layer "
        "frees less than a sixth of this tiny model's peak: its embeddings, head or "
        "optimizer state weigh more than its 2 layers' activations), the refusal names the "
        "smallest budget that recompute's plan keeps; the loop then runs again under "
        '`offload(model, policy="recompute", gpu_memory=<that budget>)`, every layer still '
        "re-run, and a family that passes so is counted apart ('at its smallest budget').\n\n"
        "The plain loop passes `use_cache=False` where the model's forward takes it, "
        "because that is what offload runs: it passes `use_cache=False` to every training "
        "forward that does not say (as transformers' gradient checkpointing does), since a "
        "cache would keep every layer's keys and values beyond their backward (and a "
        "re-run layer would append its own twice). A forward with the cache is another "
        "computation, not always equal to the bit: in tests/training/test_loop_shapes.py, "
        "GPT-2 with dropout 0.1 gives the same losses with and without the cache but other "
        "weights in the last bits, because the cache hands attention contiguous copies of "
        "the keys and values (DynamicCache concatenates them) where the uncached forward "
        "hands it views of the projection, and on the CPU the backward of "
        "scaled_dot_product_attention with dropout differs in the last bits with the "
        "layout. So the test, and this page, compare offload with the loop run without the "
        "cache (the tiny models here have no dropout).\n\n"
        "Which forwards take use_cache is what offload decides (`takes_use_cache`): those "
        "that name it, and those that take `**kwargs` and pass them on to a submodule that "
        "names it (GraniteMoE's causal LMs and Gemma 3's classifier among others: before "
        "offload knew these, it left their cache on, and a recomputed layer appended its "
        "keys twice).\n\n"
        "Last column: after the loop, a call with `use_cache=True` (and, where the forward "
        "takes the cache itself, `cache` in transformers 5, `past_key_values` before, one "
        "with a `transformers.DynamicCache`) is made under offload; 'refused' means each "
        "raised pipeswap's error naming what it asked for before any layer ran; '-': the "
        "forward takes no use_cache. "
        "'not built' and 'not run': the family's tiny config could not be made or trained "
        "plainly on these batches (the detail says why); they say nothing about pipeswap. "
        "'nothing recomputed': offload's default layers (the list of layers with most "
        "parameters) are not what a text forward calls (GOT-OCR2's are its vision tower's); "
        "name the layers (`offload(model, layers=[...])`). ALBERT has no list of layers: "
        "it shares one layer's weights across its depth, one module called once a layer, "
        "which no plan can cut into layers.\n\n" + "\n".join(lines) + "\n"
    )


def family_main(
    argv: list[str] | None,
    doc: str,
    quick_names: tuple[str, ...],
    results: Path,
    run_rows: Callable[[bool], list[dict[str, Any]]],
    render_rows: Callable[[list[dict[str, Any]], float, list[str] | None], str],
) -> int:
    """A family benchmark's command line: ``--quick`` and ``--out``, one thread, the rows
    of ``run_rows`` rendered and written."""
    import transformers

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{', '.join(quick_names)} only (tests)"
    )
    parser.add_argument("--out", type=Path, default=results, help="where to write the tables")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, too_long)
    started = time.perf_counter()
    rows = run_rows(args.quick)
    text = render_rows(rows, time.perf_counter() - started, argv)
    write_atomic(args.out, text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    assert __doc__ is not None
    return family_main(argv, __doc__, QUICK, RESULTS, run, render)


if __name__ == "__main__":
    raise SystemExit(main())
