"""The memory/time frontier: pipeswap at several budgets against every peer, one interleaved run.

    .venv/bin/python benchmarks/memory_frontier.py          # CPU: docs/results/memory_frontier.md
    .venv/bin/python benchmarks/memory_frontier.py --device cuda --hidden 2048 --layers 16 \\
        --vocab 32000 --batch 8 --seq 2048                 # a 1 B Llama: memory_frontier_cuda.md
    .venv/bin/python benchmarks/memory_frontier.py --quick  # a small run, nothing under docs/

An HF Llama in the user's own loop: bf16-mixed (torch.autocast), AdamW, the model's own loss.
Each way of saving memory that runs here is a peer: full activation checkpointing per
decoder layer (HF ``gradient_checkpointing_enable``), selective activation checkpointing
(torch's ``create_selective_checkpoint_contexts`` with an op policy: torchtitan's "op" SAC),
torch.compile's min-cut rematerialization under ``activation_memory_budget``, and
``torch.autograd.graph.save_on_cpu``. pipeswap (``offload(..., optimizer=...)`` and
``plan_for`` before the loop) runs at the no-swap peak / each ``--ratios`` and at the peak of
the best (least-memory) peer; a budget it refuses is a row naming the smallest budget that
works, and pipeswap runs at that one too. At each ratio pipeswap's policy ``finer`` also runs
twice, recomputing only: per layer kept, recomputed whole or recomputed selectively, and
with ``whole_blocks`` (whole blocks only); the page compares the time each adds to plain.

Every way takes two warm-up steps (compiling; the peers' second is metered to find the best
peer's peak) and then the same steps, each way its step i in turn, so the machine's noise
falls on all alike (median step, x plain). A second pass runs more steps under the device's
meter (pipeswap.profiling.meter, as benchmarks/memory_truth.py: CUDA's allocator; on the CPU
the live storages, pipeswap's host pool left out) for each way's peak. On CUDA the
allocator's peak is the whole process's, so each way runs in a process of its own, one
after another (times then are not interleaved).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import RESULTS_DIR, header  # noqa: E402
from benchmarks.memory_truth import Model  # noqa: E402
from benchmarks.offload_shapes import Way, _always, _on_cpu, _sync  # noqa: E402
from pipeswap.config_fields import ConfigError  # noqa: E402
from pipeswap.profiling.meter import DeviceMeter, StorageMeter  # noqa: E402
from pipeswap.swap.swap_config import SwapConfig  # noqa: E402
from pipeswap.training.offload import offload  # noqa: E402

MiB = 2**20
WARMUP = 2  # steps every way takes before the timed ones (data[0]: compile; data[1]: probe)
SMALLEST = "the smallest that works"
CHECKED = ("plain", "compile")  # ways whose storage count is checked against the allocator
FINER = "pipeswap recompute"  # the rows of policy finer: "<FINER> <way>, no-swap/<r>"
OVER = 1.02  # a pipeswap row's measured peak may exceed its budget by this factor at most
NOT_HERE = {"trl": "TRL activation offloading", "transformer_engine": "Transformer Engine offload"}
KINDS = {
    "plain": "plain",
    "full-ac": "full AC (HF, per layer)",
    "sac": "selective AC (op SAC)",
    "save_on_cpu": "save_on_cpu",
}


@dataclass(frozen=True)
class Spec:
    """One row: a peer (``kind``) or pipeswap at a footprint ratio, a budget or the best peer's."""

    name: str
    kind: str  # plain | full-ac | sac | compile | save_on_cpu | absent | pipeswap
    ratio: float | None = None
    budget: int | None = None  # pipeswap's gpu_memory in bytes
    best: bool = False  # pipeswap at the best peer's peak (resolved in the run)
    activation_budget: float | None = None  # torch.compile's activation_memory_budget
    policy: str | None = None  # pipeswap's policy (None: offload's default)
    whole_blocks: bool = False  # pipeswap recomputes whole blocks only
    origin: str = ""  # where a pipeswap budget came from, or why an absent peer is absent


@dataclass
class Entry(Way):
    """A way in the run: what the loop calls (the compiled module for compile) and its record."""

    spec: Spec | None = None
    call: torch.nn.Module | None = None
    notes: list[str] = field(default_factory=list)
    probe: int = 0  # the peak of its metered warm-up step (peers)
    rise: int = 0  # the last metered step's peak above what the meter counted at its start


def peers(args: argparse.Namespace) -> list[Spec]:
    out = [Spec(name, kind) for kind, name in KINDS.items()]
    compiled = f"torch.compile (budget {args.compile_budget:g})"
    if args.no_compile:
        why = "skipped in --quick (compiling takes minutes on a CPU)" if args.quick else ""
        out.insert(3, Spec(compiled, "absent", origin=why or "skipped (--no-compile)"))
    else:
        out.insert(3, Spec(compiled, "compile", activation_budget=args.compile_budget))
    for module, label in NOT_HERE.items():
        installed = importlib.util.find_spec(module) is not None
        why = "installed, but not run by this benchmark" if installed else "not installed here"
        out.append(Spec(label, "absent", origin=why))
    return out


def pipeswap_specs(args: argparse.Namespace) -> list[Spec]:
    out = [
        Spec(f"pipeswap no-swap/{r:g}", "pipeswap", ratio=r, origin=f"no-swap peak / {r:g}")
        for r in args.ratios
    ]
    # Recomputation only, finer than a block against whole blocks, at the same budgets.
    for r in args.ratios:
        for whole in (True, False):
            way = "whole blocks" if whole else "finer"
            origin = f"no-swap peak / {r:g}; recompute only, {way}"
            name = f"{FINER} {way}, no-swap/{r:g}"
            out.append(
                Spec(name, "pipeswap", ratio=r, policy="finer", whole_blocks=whole, origin=origin)
            )
    return out + [Spec("pipeswap at best peer", "pipeswap", best=True)]


def model_spec(args: argparse.Namespace) -> Model:
    return Model("llama", "llama", args.hidden, args.layers, args.vocab, args.batch, args.seq)


# ---- the peers ------------------------------------------------------------------------------
def selective(model: torch.nn.Module) -> None:
    """torchtitan's op SAC: each decoder layer checkpointed, matmul and attention outputs
    saved, everything else (norms, activations, rotary, autocast's casts) recomputed."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = [
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    keep = [aten.mm.default, aten.addmm.default, aten.bmm.default]
    keep += [getattr(aten, name).default for name in names if hasattr(aten, name)]
    context = functools.partial(create_selective_checkpoint_contexts, keep)
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for layer in layers:

        def forward(*args: Any, _forward: Any = layer.forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=context, **kwargs)

        layer.forward = forward


class _SeesCompiled(StorageMeter):
    """The storage count, let into compiled code: Dynamo runs a compiled frame under a
    dispatch mode only if the mode ignores compile internals (else it runs it eagerly)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _count_inductor_buffers() -> None:
    """Inductor's CPU wrapper allocates its buffers by a fast path that bypasses the
    dispatcher (``_empty_strided_cpu``), unseen by any dispatch mode; route it through
    ``torch.empty_strided`` so that the storage count sees them (before anything compiles:
    each compiled module binds the function when it loads)."""
    guards: Any = torch._C._dynamo.guards

    def empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")

    guards._empty_strided_cpu = empty_strided_cpu


def build(
    spec: Spec, args: argparse.Namespace, device: torch.device, first: dict[str, Any]
) -> Entry:
    """The way ``spec`` names, ready for its warm-up steps (pipeswap: planned for ``first``)."""
    model: Any = model_spec(args).build(device)  # an HF LlamaForCausalLM
    model.config.use_cache = False  # as offload and HF checkpointing run it: no KV cache
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrap: Callable[[], AbstractContextManager[Any]] = nullcontext
    call: torch.nn.Module = model
    off = None
    notes: list[str] = []
    if spec.kind == "plain":
        notes.append("nothing recomputed or offloaded")
    elif spec.kind == "full-ac":
        model.gradient_checkpointing_enable({"use_reentrant": False})
        notes.append("every decoder layer recomputed")
    elif spec.kind == "sac":
        selective(model)
        notes.append("per layer: mm and attention outputs kept, the rest recomputed")
    elif spec.kind == "compile":
        if device.type == "cpu":
            _count_inductor_buffers()
        call = torch.compile(model)  # type: ignore[assignment]
        notes.append("inductor, min-cut rematerialization")
    elif spec.kind == "save_on_cpu":
        pin = device.type == "cuda"
        wrap = _on_cpu(pin=pin)
        notes.append(f"pin_memory={pin}")
    elif spec.kind == "pipeswap":
        off = offload(
            model,
            footprint_ratio=spec.ratio,
            gpu_memory=spec.budget,
            optimizer=optimizer,
            policy=spec.policy or SwapConfig.policy,
            whole_blocks=spec.whole_blocks,
        )
        with _autocast(device):
            off.plan_for(**first)  # raises ConfigError for a budget it refuses
        wrap = _always(off)
    way = Entry(spec.name, model, optimizer, wrap, off, spec=spec, call=call, notes=notes)
    return way


def _autocast(device: torch.device) -> AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16)


# ---- a step ---------------------------------------------------------------------------------
def step(way: Entry, batch: dict[str, Any], device: torch.device, *, meter: bool) -> None:
    """One whole step (forward, backward, optimizer step): timed, or under the meter."""
    metering: Any = nullcontext()
    if meter:
        pools = way.off.host_pools() if way.off is not None else []
        held = (way.model, way.optimizer, batch)
        compiled = way.spec is not None and way.spec.kind == "compile"
        metering = (
            _SeesCompiled("cpu", holding=held, exclude=pools)
            if compiled and device.type == "cpu"
            else DeviceMeter(device, holding=held, exclude=pools)
        )
    _sync(device)
    started = time.perf_counter()
    with metering:
        start = metering.current if meter else 0
        with _autocast(device):
            with way.wrap():
                assert way.call is not None
                loss = way.call(**batch).loss
        loss.backward()
        way.optimizer.step()
        way.optimizer.zero_grad(set_to_none=True)
        _sync(device)
    elapsed = time.perf_counter() - started
    if meter:
        way.peaks.append(int(metering.peak))
        way.rise = int(metering.peak) - start
    else:
        way.times.append(elapsed)
        way.losses.append(loss.item())


def _allocator_check(way: Entry, batch: dict[str, Any], device: torch.device) -> str:
    """One more step under torch.profiler's memory events (every CPU allocation and free,
    as the allocator reports them): the most they rose above the step's start, against the
    storage count's rise in the last metered step (same shapes, same allocations)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step(way, batch, device, meter=False)
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    except Exception as exc:  # noqa: BLE001 - the check is a note, not the measurement
        return f"allocator check failed ({type(exc).__name__})"
    way.times.pop()  # a profiled step is not a timed one
    way.losses.pop()
    now = rise = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        now += event.nbytes()
        rise = max(rise, now)
    same = "the same" if rise == way.rise else f"meter {way.rise / MiB:.2f} MiB"
    return f"CPU allocator's own rise in a step {rise / MiB:.2f} MiB ({same})"


# ---- a run ----------------------------------------------------------------------------------
def run_ways(
    specs: Sequence[Spec],
    args: argparse.Namespace,
    device: torch.device,
    *,
    add_smallest: bool,
) -> list[dict[str, Any]]:
    """Every way of ``specs`` in this process, interleaved; one record per row, in order.

    The peers first take their warm-up steps (the second metered: the best peer's peak),
    then pipeswap's ways are built (``best``: at that peak) and take theirs; a refused
    budget adds pipeswap at the smallest budget that works (``add_smallest``)."""
    data = model_spec(args).batches(WARMUP + args.steps, device)
    rows: list[Entry | dict[str, Any]] = []
    running: list[Entry] = []
    for spec in (s for s in specs if s.kind != "pipeswap"):
        if spec.kind == "absent":
            rows.append(_skipped(spec, spec.origin))
            continue
        way = build(spec, args, device, data[0])
        failed = _warm(way, data, device, probe=True)
        rows.append(failed or way)
        if failed is None:
            running.append(way)
    ran = [w.probe for w in running if w.spec is not None and w.spec.kind != "plain"]
    best = min(ran) if ran else None
    best_name = next((w.name for w in running if w.probe == best), "")
    queue = [s for s in specs if s.kind == "pipeswap"]
    taken = {(s.budget, s.policy) for s in queue}
    while queue:
        spec = queue.pop(0)
        if spec.best:
            if best is None:
                rows.append(_skipped(spec, "no peer ran"))
                continue
            spec = Spec(spec.name, spec.kind, budget=best, origin=f"{best_name}'s peak")
        try:
            way = build(spec, args, device, data[0])
        except ConfigError as exc:
            refused = _refused(spec, exc)
            rows.append(refused)
            again = follow_up(spec, refused, taken) if add_smallest else None
            if again is not None:
                queue.append(again)
            continue
        _warm(way, data, device, probe=False)
        rows.append(way)
        running.append(way)
    for batch in data[WARMUP:]:  # interleaved: each way takes the same step in turn
        for way in running:
            step(way, batch, device, meter=False)
    for batch in data[WARMUP : WARMUP + args.metered]:
        for way in running:
            step(way, batch, device, meter=True)
    for way in running:  # the storage count against the CPU allocator's own events
        if device.type == "cpu" and way.spec is not None and way.spec.kind in CHECKED:
            way.notes.append(_allocator_check(way, data[WARMUP], device))
    return [row if isinstance(row, dict) else _record(row) for row in rows]


def _warm(
    way: Entry, data: list[dict[str, Any]], device: torch.device, *, probe: bool
) -> dict[str, Any] | None:
    """The way's warm-up steps (compiling in the first); None, or the record of its failure."""
    assert way.spec is not None
    started = time.perf_counter()
    try:
        if way.spec.kind == "compile":
            import torch._functorch.config as functorch_config

            knob = way.spec.activation_budget
            with functorch_config.patch(activation_memory_budget=knob):
                step(way, data[0], device, meter=False)
            way.notes.append(f"first step (compiling) {time.perf_counter() - started:.0f} s")
        else:
            step(way, data[0], device, meter=False)
        step(way, data[1], device, meter=probe)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a row too
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return _skipped(way.spec, f"failed: {type(exc).__name__}: {reason}")
    if probe:
        way.probe = way.peaks.pop()
    way.times.clear()
    way.losses.clear()
    return None


def _skipped(spec: Spec, why: str) -> dict[str, Any]:
    return {"spec": asdict(spec), "status": "skipped", "notes": why}


def follow_up(spec: Spec, refused: dict[str, Any], taken: set[Any]) -> Spec | None:
    """What to run after a refusal (None: nothing new): pipeswap at the smallest budget
    the refusal names; if that budget is refused too because no plan of the default
    policy fits it, the same budget with policy hybrid, as that refusal advises."""
    again = None
    if refused.get("smallest") is not None:
        again = Spec("pipeswap smallest", "pipeswap", budget=refused["smallest"], origin=SMALLEST)
    elif (
        spec.origin == SMALLEST and spec.policy is None and "no plan of policy" in refused["notes"]
    ):
        again = Spec(
            "pipeswap smallest, hybrid",
            "pipeswap",
            budget=spec.budget,
            origin=f"{SMALLEST}, with policy hybrid (as the refusal advises)",
            policy="hybrid",
        )
    if again is None or (again.budget, again.policy) in taken:
        return None
    taken.add((again.budget, again.policy))
    return again


def _refused(spec: Spec, exc: ConfigError) -> dict[str, Any]:
    text = str(exc)
    found = re.search(r"smallest budget that works is (\d+) bytes", text)
    asked = re.search(r"a budget of (\d+) bytes", text)
    smallest = int(found.group(1)) if found else None
    record: dict[str, Any] = {
        "spec": asdict(spec),
        "status": "refused",
        "budget": int(asked.group(1)) if asked else spec.budget,
        "smallest": smallest,
        "notes": (
            f"refused (smallest: {smallest / MiB:.1f} MiB)"
            if smallest is not None
            else "refused: " + text.splitlines()[0].split(": ")[0][:160]
        ),
    }
    if spec.origin:
        record["notes"] += f"; asked: {spec.origin}"
    return record


def _record(way: Entry) -> dict[str, Any]:
    assert way.spec is not None
    notes = list(way.notes)
    budget = None
    if way.off is not None:
        stats = way.off.stats()
        budget = int(stats["budget_bytes"])
        notes = [
            f"policy {stats.get('policy')}",
            f"layers recomputed: {stats.get('recomputed_layers', 0)} "
            f"({stats.get('selective_layers', 0)} selectively)",
            f"{stats.get('swapped_bytes', 0) / MiB:.1f} MiB swapped",
            f"{stats.get('shared_bytes', 0) / MiB:.1f} MiB of repeated casts kept once",
        ]
        if way.spec.origin:
            notes.insert(0, f"budget: {way.spec.origin}")
    return {
        "spec": asdict(way.spec),
        "status": "ran",
        "budget": budget,
        "times": way.times,
        "losses": way.losses,
        "peaks": way.peaks,
        "probe": way.probe,
        "notes": "; ".join(notes),
    }


# ---- on CUDA: each way in a process of its own ----------------------------------------------
def run_isolated(
    specs: Sequence[Spec], args: argparse.Namespace, argv: Sequence[str]
) -> list[dict[str, Any]]:
    """As :func:`run_ways`, each way in a child process (the allocator's peak is the
    process's), one after another: the peers first, then pipeswap at the best one's peak."""
    records: list[dict[str, Any]] = []
    for spec in (s for s in specs if s.kind != "pipeswap"):
        records += [_skipped(spec, spec.origin)] if spec.kind == "absent" else _child(spec, argv)
    ran = [r for r in records if r["status"] == "ran" and r["spec"]["kind"] != "plain"]
    best = min(ran, key=lambda r: max(r["peaks"]), default=None)
    queue = [s for s in specs if s.kind == "pipeswap"]
    taken = {(s.budget, s.policy) for s in queue}
    while queue:
        spec = queue.pop(0)
        if spec.best:
            if best is None:
                records.append(_skipped(spec, "no peer ran"))
                continue
            peak, name = max(best["peaks"]), best["spec"]["name"]
            spec = Spec(spec.name, spec.kind, budget=peak, origin=f"{name}'s peak")
        found = _child(spec, argv)
        records += found
        again = follow_up(spec, found[-1], taken) if found[-1]["status"] == "refused" else None
        if again is not None:
            queue.append(again)
    return records


def _child(spec: Spec, argv: Sequence[str]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, __file__, *argv, "--way", json.dumps(asdict(spec))],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"records"')]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return [_skipped(spec, f"failed: {last}")]
    records: list[dict[str, Any]] = json.loads(lines[-1])["records"]
    return records


# ---- the page -------------------------------------------------------------------------------
def _peak(record: dict[str, Any]) -> int:
    return max(record["peaks"])


def _median(record: dict[str, Any]) -> float:
    return statistics.median(record["times"])


def _vs_plain(record: dict[str, Any], plain: dict[str, Any] | None) -> str:
    if plain is None:
        return "-"
    if record["losses"] == plain["losses"]:
        return "bit-identical"
    diff = max(abs(a - b) for a, b in zip(record["losses"], plain["losses"], strict=True))
    return f"max diff {diff:.1e}"


def table(records: list[dict[str, Any]]) -> list[str]:
    plain = next(
        (r for r in records if r["spec"]["kind"] == "plain" and r["status"] == "ran"), None
    )
    lines = [
        "| way | budget MiB | measured peak MiB | peak / budget | median step ms | x plain | "
        "losses vs plain | notes |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for record in records:
        budget = record.get("budget")
        cells = [record["spec"]["name"], "-" if budget is None else f"{budget / MiB:.1f}"]
        if record["status"] == "ran":
            peak, median = _peak(record), _median(record)
            cells += [
                f"{peak / MiB:.1f}",
                "-" if budget is None else f"{peak / budget:.3f}",
                f"{median * 1e3:.0f}",
                "-" if plain is None else f"{median / _median(plain):.2f}",
                _vs_plain(record, plain),
            ]
        else:
            cells += ["-"] * 5
        cells.append(record["notes"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def same_memory(records: list[dict[str, Any]]) -> list[str]:
    """For each peer that ran: the fastest pipeswap row that held no more than it did."""
    ran = [r for r in records if r["status"] == "ran"]
    ours = [r for r in ran if r["spec"]["kind"] == "pipeswap"]
    lines = [
        "| peer | its peak MiB | its step ms | fastest pipeswap at no more memory | "
        "peak MiB | step ms | time / peer's |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for peer in ran:
        if peer["spec"]["kind"] in ("plain", "pipeswap"):
            continue
        fits = [r for r in ours if _peak(r) <= _peak(peer)]
        cells = [peer["spec"]["name"], f"{_peak(peer) / MiB:.1f}", f"{_median(peer) * 1e3:.0f}"]
        if fits:
            fastest = min(fits, key=_median)
            cells += [
                fastest["spec"]["name"],
                f"{_peak(fastest) / MiB:.1f}",
                f"{_median(fastest) * 1e3:.0f}",
                f"{_median(fastest) / _median(peer):.2f}",
            ]
        else:
            cells += ["none held that little", "-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def finer_than_blocks(records: list[dict[str, Any]]) -> list[str]:
    """At each budget: recomputation finer than a block against whole blocks, both
    recompute-only plans of policy finer; the time each adds to plain's step, as a ratio."""
    plain = next(
        (r for r in records if r["spec"]["kind"] == "plain" and r["status"] == "ran"), None
    )
    ran = {r["spec"]["name"]: r for r in records if r["status"] == "ran"}
    lines = [
        "| budget | whole blocks: peak MiB, step ms | finer: peak MiB, step ms | "
        "time added to plain's step, finer / whole | step, finer / whole |",
        "|---|---:|---:|---:|---:|",
    ]
    for record in records:
        name = record["spec"]["name"]
        if not name.startswith(f"{FINER} whole blocks, "):
            continue
        ratio = name.split(", ")[-1]
        whole, finer = ran.get(name), ran.get(f"{FINER} finer, {ratio}")
        if whole is None or finer is None or plain is None:
            lines.append(f"| {ratio} | - | - | - | - |")
            continue
        base = _median(plain)
        whole_added, finer_added = _median(whole) - base, _median(finer) - base
        # On a shared machine plain's median may come out above a recomputing row's.
        added = (
            f"{finer_added / whole_added:.2f}"
            if whole_added > 0 and finer_added >= 0
            else "- (plain's median above)"
        )
        lines.append(
            f"| {ratio} ({record['budget'] / MiB:.1f} MiB) | {_peak(whole) / MiB:.1f}, "
            f"{_median(whole) * 1e3:.0f} | {_peak(finer) / MiB:.1f}, {_median(finer) * 1e3:.0f} "
            f"| {added} | {_median(finer) / _median(whole):.2f} |"
        )
    return lines


def _ms_per_mib_freed(record: dict[str, Any] | None, plain: dict[str, Any]) -> float | None:
    """Step time a way adds to plain's per MiB of peak it frees below plain's (None when it
    frees nothing or adds no time)."""
    if record is None:
        return None
    freed = (_peak(plain) - _peak(record)) / MiB
    added = (_median(record) - _median(plain)) * 1e3
    return added / freed if freed > 0 and added > 0 else None


def per_mib_freed(records: list[dict[str, Any]]) -> str:
    """Time per MiB freed: pipeswap's finer plans against its whole-block ones, and torch's
    op-level SAC against HF's full AC in the same run (does finer pay on this device?)."""
    ran = {r["spec"]["name"]: r for r in records if r["status"] == "ran"}
    plain = next((r for r in ran.values() if r["spec"]["kind"] == "plain"), None)
    if plain is None:
        return ""
    pairs = [
        (f"{FINER} finer, {name.split(', ')[-1]}", name, "pipeswap finer / whole blocks")
        for name in ran
        if name.startswith(f"{FINER} whole blocks, ")
    ]
    pairs.append(("selective AC (op SAC)", "full AC (HF, per layer)", "op SAC / full AC"))
    parts = []
    for fine, whole, label in pairs:
        a, b = _ms_per_mib_freed(ran.get(fine), plain), _ms_per_mib_freed(ran.get(whole), plain)
        if a is not None and b is not None:
            budget = f" at {whole.split(', ')[-1]}" if whole.startswith(FINER) else ""
            parts.append(f"{label}{budget}: {a:.2f} / {b:.2f} ms per MiB = {a / b:.2f}")
    if not parts:
        return ""
    return (
        "Step time added to plain's per MiB of peak freed below plain's (the cost of a "
        "byte, whatever the budget): " + "; ".join(parts) + ". Below 1, finer pays."
    )


def summary(records: list[dict[str, Any]]) -> str:
    plain = next(
        (r for r in records if r["spec"]["kind"] == "plain" and r["status"] == "ran"), None
    )
    ours = [r for r in records if r["spec"]["kind"] == "pipeswap" and r["status"] == "ran"]
    within = sum(1 for r in ours if _peak(r) <= r["budget"] * OVER)
    same = sum(1 for r in ours if plain is not None and r["losses"] == plain["losses"])
    refused = sum(1 for r in records if r["status"] == "refused")
    return (
        f"pipeswap ran at {len(ours)} budgets ({refused} refused): measured peak within "
        f"budget x {OVER}: {within} of {len(ours)}; losses bit-identical to plain: "
        f"{same} of {len(ours)}."
    )


CPU_MEANING = """\
**What the CPU numbers mean.** On a CPU the "device" and the host are the same memory, so
swapping saves no memory here at all: the bytes pipeswap moves to its host pool are still in
RAM. The meter counts them the way a GPU's meter would: it leaves pipeswap's host pool out
(CUDA's allocator never sees host memory), so pipeswap's rows show what its plan would hold
on a device. torch's `save_on_cpu` gets no such allowance: its copies are ordinary CPU
storages, so the meter counts them and on a CPU it saves nothing (on a GPU its copies would
be host memory too, and uncounted). The memory columns are exact (the live storages of each
step, counted as torch's MemTracker counts them); the times are indicative only: a CPU step
is not a GPU step, the machine may be shared with other jobs, and a copy within RAM is no
model of PCIe (a swap here costs a memcpy, and pipeswap's rows may even come out faster than
plain). The time a swap costs on a GPU, and whether it overlaps compute, is what the CUDA
run of this script measures.
"""

CUDA_MEANING = """\
**What the CUDA numbers mean.** The peak is CUDA's allocator's (`max_memory_allocated` over
each whole step); pipeswap's host pool and `save_on_cpu`'s copies are pinned host memory,
which the allocator does not count. Each way ran in a process of its own, one after another
(the allocator's peak is the process's), so its times are not interleaved with the others'.
"""


def render(
    records: list[dict[str, Any]],
    args: argparse.Namespace,
    device: torch.device,
    argv: Sequence[str],
    elapsed: float,
) -> str:
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    params = sum(p.numel() for p in model_spec(args).build(torch.device("meta")).parameters())
    return "\n".join(
        [
            header(
                f"Memory/time frontier ({card}): pipeswap against every peer", _SCRIPT, argv
            ).rstrip("\n")
            + "\n",
            f"HF Llama ({params / 1e6:.1f} M parameters: hidden {args.hidden}, {args.layers} "
            f"layers, vocab {args.vocab}), bf16-mixed (torch.autocast), AdamW, batches of "
            f"{args.batch} x {args.seq} tokens, {torch.get_num_threads()} CPU thread"
            f"{'s' if torch.get_num_threads() > 1 else ''}. Median of "
            f"{args.steps} {'' if args.isolate else 'interleaved '}steps after "
            f"{WARMUP} warm-up steps; the peak is the most any of {args.metered} metered "
            "steps held (forward, backward and optimizer step, with the weights, gradients, "
            "AdamW state and batch). pipeswap's no-swap peak is what its own step holds "
            "when it moves nothing: below plain's by the repeated casts it keeps once "
            "(docs/concepts.md, Mixed precision). Its budgets are that peak / "
            f"{', '.join(f'{r:g}' for r in args.ratios)} and the peak of the peer that held "
            "least; 'losses vs plain' compares every timed step's loss. The whole run took "
            f"{elapsed:.0f} s.\n",
            *table(records),
            "",
            summary(records),
            "",
            "At the same memory: for each peer, the fastest pipeswap row whose measured peak "
            "is at most the peer's.\n",
            *same_memory(records),
            "",
            "Finer than a block: at each budget, policy `finer` recomputing only (nothing "
            "swapped), per layer kept, recomputed whole or recomputed selectively (its "
            "matmuls' and attention's outputs kept, its cheap operations re-run), against "
            "the same policy with `whole_blocks` (whole blocks only, the fewest that fit). "
            "Both rows are in the table above, interleaved in one run; the ratio compares "
            "the time each adds to plain's median step.\n",
            *finer_than_blocks(records),
            "",
            per_mib_freed(records),
            "",
            f"![peak memory against step time]({_png_name(device)})",
            "",
            CPU_MEANING if device.type == "cpu" else CUDA_MEANING,
            "**The peers.** Full AC: `model.gradient_checkpointing_enable({'use_reentrant': "
            "False})`. Selective AC: each decoder layer's forward under "
            "`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)` "
            "with `create_selective_checkpoint_contexts` keeping the outputs of `mm`, "
            "`addmm`, `bmm` and the SDPA kernels (torchtitan's op SAC, which by default also "
            "recomputes every second `mm`; this keeps them all). torch.compile: the whole "
            "model under `torch.compile` (inductor), compiled with "
            "`torch._functorch.config.activation_memory_budget` set "
            f"({args.compile_budget:g}: the min-cut partitioner may save that fraction of "
            "the activations it would save at 1.0). On a CPU a dispatch mode that does not "
            "declare `ignore_compile_internals` makes Dynamo run compiled frames eagerly, "
            "and inductor's CPU buffers are allocated past the dispatcher: compile's step "
            "is metered by the same storage count marked to ignore compile internals, with "
            "inductor's `_empty_strided_cpu` routed through `torch.empty_strided` so that "
            "its buffers are counted. As a check, plain and compile each run one more step "
            "under `torch.profiler`'s memory events (every allocation and free the CPU "
            "allocator reports); their notes give how far those rose above the step's start "
            "beside the storage count's rise (on a CPU only: on CUDA the allocator is the "
            "meter). Inductor's on-disk cache makes a compile after the first faster: the "
            "first step's time says which this was. `save_on_cpu`: "
            "`torch.autograd.graph.save_on_cpu(pin_memory=<on CUDA>)` around the forward. "
            "TRL's and Transformer Engine's activation offloading are not installed here; "
            "their rows say so rather than stand in for them.\n",
            "<details><summary>Every step's numbers (JSON: peaks in bytes, times in s, "
            "losses)</summary>\n",
            "```json",
            json.dumps([_brief(r) for r in records]),
            "```",
            "</details>",
            "",
        ]
    )


def _brief(record: dict[str, Any]) -> dict[str, Any]:
    keep = ("budget", "peaks", "times", "losses", "status")
    out = {"way": record["spec"]["name"], **{k: record[k] for k in keep if k in record}}
    if "times" in out:
        out["times"] = [round(t, 4) for t in out["times"]]
    return out


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in records if r["status"] == "ran"]
    figure, axes = plt.subplots(figsize=(8, 5.5))
    markers = iter("osD^vP*X")
    for record in ran:
        if record["spec"]["kind"] == "pipeswap":
            continue
        x, y = _median(record) * 1e3, _peak(record) / MiB
        axes.scatter([x], [y], marker=next(markers), s=70, label=record["spec"]["name"], zorder=3)
    ours = sorted((r for r in ran if r["spec"]["kind"] == "pipeswap"), key=_peak)
    if ours:
        xs = [_median(r) * 1e3 for r in ours]
        ys = [_peak(r) / MiB for r in ours]
        axes.plot(xs, ys, "-o", color="black", label="pipeswap (its budgets)", zorder=4)
        for r, x, y in zip(ours, xs, ys, strict=True):
            axes.annotate(
                r["spec"]["name"].removeprefix("pipeswap "),
                (x, y),
                textcoords="offset points",
                xytext=(6, -3),
                fontsize=8,
            )
    axes.set_xlabel("median step time (ms)")
    axes.set_ylabel("measured peak memory (MiB)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


_SCRIPT = "memory_frontier.py"


def _png_name(device: torch.device) -> str:
    return "memory_frontier.png" if device.type == "cpu" else "memory_frontier_cuda.png"


# ---- the command ----------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per way")
    parser.add_argument("--metered", type=int, default=2, help="metered steps per way")
    parser.add_argument("--ratios", default="1.25,1.5,2,3", help="pipeswap's footprint ratios")
    parser.add_argument("--compile-budget", type=float, default=0.5)
    parser.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's CPU threads (default on a CPU 1: on a shared machine a pool of several "
        "stalls whenever another job takes one of its cores; on CUDA torch's own)",
    )
    parser.add_argument("--quick", action="store_true", help="a small run; writes only --out")
    parser.add_argument("--out", default=None, help="the page to write (a PNG beside it)")
    parser.add_argument("--way", help=argparse.SUPPRESS)  # one way, in a child (CUDA)
    parser.add_argument("--isolate", action="store_true", help=argparse.SUPPRESS)  # as on CUDA
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    args.ratios = [float(r) for r in args.ratios.split(",") if r]
    if args.quick:
        args.hidden, args.layers, args.vocab, args.batch, args.seq = 128, 4, 512, 2, 128
        args.steps, args.metered, args.no_compile = 3, 1, True
        args.ratios = [1.25, 3.0]
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    if args.threads is None and device.type == "cpu":
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.way:
        spec = Spec(**json.loads(args.way))
        print(json.dumps({"records": run_ways([spec], args, device, add_smallest=False)}))
        return 0
    specs = peers(args) + pipeswap_specs(args)
    started = time.perf_counter()
    args.isolate = args.isolate or device.type == "cuda"
    if args.isolate:
        records = run_isolated(specs, args, given)
    else:
        records = run_ways(specs, args, device, add_smallest=True)
    elapsed = time.perf_counter() - started
    page = render(records, args, device, given, elapsed)
    print(page)
    if args.quick and args.out is None:
        return 0
    out = Path(args.out) if args.out else RESULTS_DIR / _png_name(device).replace(".png", ".md")
    out.write_text(page)
    image = out.parent / _png_name(device) if args.out is None else out.with_suffix(".png")
    where = "CPU: memory exact, times indicative" if device.type == "cpu" else "CUDA"
    plot(records, image, f"HF Llama, hidden {args.hidden}, {args.layers} layers ({where})")
    if image.name != _png_name(device):
        out.write_text(page.replace(f"]({_png_name(device)})", f"]({image.name})"))
    print(f"written to {out} and {image}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
