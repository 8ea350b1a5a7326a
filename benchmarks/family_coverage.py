"""Which Hugging Face families train through pipeswap.offload and pipeswap.Pipeline.

Run from the repository root:

    .venv/bin/python benchmarks/family_coverage.py                 # every family
    .venv/bin/python benchmarks/family_coverage.py --quick --out /tmp/f.md   # a few

For every model type in transformers' auto mappings for causal LMs, masked LMs, sequence
classification and image classification, a tiny config is made from the family's own
config class (its defaults, with every size attribute it has shrunk: hidden 32, 2 layers,
4 heads, vocabulary 128, ...; nothing is downloaded), the model is built from it, and
three steps of a plain loop (AdamW, the batch as keyword arguments with labels, the
model's own loss) run with and without `pipeswap.offload(model, policy="save-on-cpu")`,
which moves every activation the blocks save to host memory. A family is covered when
both loops give the same losses and parameters bit for bit and tensors were moved. Then
a 2-stage gpipe pipeswap.Pipeline (two processes over gloo) trains the same model on the
same batches; it covers the family when its losses are the plain loop's (relative 1e-5).
The table gives the reason for every other family.
"""

from __future__ import annotations

import argparse
import inspect
import signal
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, header
from torch import nn

from pipeswap.dist.launch import spawn
from pipeswap.dist.peers import lost_peers
from pipeswap.jsonio import write_atomic
from pipeswap.training.offload import offload
from pipeswap.training.pipe import Pipeline

RESULTS = RESULTS_DIR / "family_coverage.md"
HIDDEN, LAYERS, HEADS, VOCAB, SEQ, BATCH = 32, 2, 4, 128, 16, 2
MAX_PARAMETERS = 20_000_000
TIME_LIMIT_S = 120  # per family
PIPELINE_REL = 1e-5  # a pipeline's losses against the plain loop's, relative
QUICK = ("llama", "gpt2", "bert", "vit")  # --quick's families


def too_long(signum: int, frame: Any) -> None:
    """SIGALRM's handler: a family past its time limit (signal.alarm(TIME_LIMIT_S))."""
    raise TimeoutError


SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim"), HIDDEN),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "n_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
        ),
        LAYERS,
    ),
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_key_value_heads",
            "n_kv_heads",
            "num_kv_heads",
        ),
        HEADS,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "n_inner",
            "d_ff",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "hidden_dim",
        ),
        64,
    ),
    **dict.fromkeys(("vocab_size",), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size"), HIDDEN // HEADS),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_topk"), 2),
    **dict.fromkeys(("image_size",), 32),
    **dict.fromkeys(("patch_size",), 8),
    **dict.fromkeys(("num_labels",), 3),
}
MAPPINGS = {
    "causal LM": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked LM": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "sequence classification": (
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForSequenceClassification",
    ),
    "image classification": (
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForImageClassification",
    ),
}


def model_types(mapping: str, quick: bool = False) -> list[str]:
    """The model types of one of transformers' auto mappings (MAPPINGS' first names), in its
    order; only QUICK's with ``quick``."""
    from transformers.models.auto import modeling_auto

    names = list(getattr(modeling_auto, mapping))
    return [n for n in names if n in QUICK] if quick else names


def tiny_config(model_type: str, *, use_cache: bool | None = False) -> Any:
    """The family's config made small: the size arguments its class takes are passed to it
    (so what it derives from them, such as per-layer types, follows), then every size
    attribute it still has is set, in its sub-configs too. ``use_cache`` is set on each
    (training: no key-value cache), or left at the family's default when None."""
    import transformers

    config_class = transformers.CONFIG_MAPPING[model_type]
    takes = inspect.signature(config_class.__init__).parameters
    config = config_class(**{k: v for k, v in SIZES.items() if k in takes})
    configs = [config]
    for name in ("text_config", "vision_config", "encoder", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            configs.append(sub)
    for each in configs:
        _shrink(each)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = _get(each, name)
            if isinstance(value, int) and value >= VOCAB:
                _set(each, name, 0)
        if "pad_token_id" in dir(each) and _get(each, "pad_token_id") is None:
            _set(each, "pad_token_id", 0)  # classifiers of a batch need one
        if use_cache is not None:
            _set(each, "use_cache", use_cache)
    return config


def too_large(auto: Any, config: Any) -> str | None:
    """Why the family's tiny model is not run (too many parameters still), or None."""
    with torch.device("meta"):
        count = sum(p.numel() for p in auto.from_config(config).parameters())
    return f"the tiny config still has {count:,} parameters" if count > MAX_PARAMETERS else None


def _shrink(config: Any) -> None:
    for name, value in SIZES.items():
        if isinstance(_get(config, name), int):
            _set(config, name, value)
    # No dropout anywhere: a pipeline's stages draw their own masks (pipeswap.pipeline.rng),
    # so only a deterministic model can equal the plain loop.
    for name in config.to_dict():
        if ("dropout" in name or "pdrop" in name) and isinstance(_get(config, name), float):
            _set(config, name, 0.0)
    if isinstance(_get(config, "rotary_dim"), int):
        _set(config, "rotary_dim", HIDDEN // HEADS)  # within a head (GPT-J, CodeGen)
    types = _get(config, "layer_types")
    if isinstance(types, list) and len(types) > LAYERS:
        _set(config, "layer_types", types[:LAYERS])


def _get(config: Any, name: str) -> Any:
    """A config attribute, or None where the family refuses to give one (per-layer ones)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _set(config: Any, name: str, value: Any) -> None:
    """Set an attribute where the family lets it be set (some are read-only properties)."""
    try:
        setattr(config, name, value)
    except Exception:
        pass


def batch_for(task: str, config: Any, size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    if task == "image classification":
        side = getattr(config, "image_size", 32)
        side = side if isinstance(side, int) else 32
        channels = getattr(config, "num_channels", 3)
        pixels = torch.rand(size, channels, side, side, generator=generator)
        return {"pixel_values": pixels, "labels": torch.randint(0, 3, (size,), generator=generator)}
    ids = torch.randint(3, VOCAB, (size, SEQ), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "sequence classification":
        batch["labels"] = torch.randint(0, 3, (size,), generator=generator)
    else:
        batch["labels"] = ids.clone()
    return batch


def loop(
    model: nn.Module, task: str, config: Any, around: Callable[[], Any]
) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        with around():
            loss = model(**batch_for(task, config, BATCH)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _pipeline_rank(rank: int, world: int, task: str, model_type: str, auto_name: str) -> Any:
    """One rank of a 2-stage gpipe pipeswap.Pipeline over the family's tiny model, trained
    as the plain loop is (3 steps, AdamW, the same batch); the losses on the last stage."""
    try:
        return _pipeline_losses(task, model_type, auto_name)
    except Exception as exc:  # the family's reason, for the table (the peer then fails too)
        return reason(exc)


def _pipeline_losses(task: str, model_type: str, auto_name: str) -> list[float | None]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = getattr(transformers, auto_name).from_config(config)
    pipe = Pipeline(
        model,
        stages=2,
        steps=3,
        schedule="gpipe",
        micro_batches=2,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
    )
    losses = []
    for _ in range(3):
        batch = batch_for(task, config, BATCH)
        inputs = batch["pixel_values" if task == "image classification" else "input_ids"]
        losses.append(pipe.step(inputs, labels=batch["labels"]))
    pipe.close()
    return losses


def check_pipeline(
    task: str, model_type: str, auto_name: str, plain: list[float]
) -> tuple[str, str]:
    """(verdict, detail) of a 2-stage pipeline of the family against its plain loop."""
    launched = spawn(_pipeline_rank, 2, task, model_type, auto_name, timeout_s=60)
    failed = [r for r in launched.results if isinstance(r, str)]
    if failed:  # the rank that raised says why (its peer then fails as a lost peer)
        return "fails", next((r for r in failed if not lost_peers(RuntimeError(r))), failed[0])
    if not launched.ok:
        message = next((m for m in launched.messages if m), "a rank failed")
        return "fails", message.splitlines()[0][:160].replace("|", "/")
    losses = launched.results[1]
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, plain, strict=True))
    if worst > PIPELINE_REL:
        return "differs", f"losses differ from the plain loop's by up to {worst:.1e} (relative)"
    return "covered", f"losses within {worst:.1e} of the plain loop's"


def check(task: str, model_type: str, auto: Any) -> tuple[str, str, list[float] | None]:
    """(verdict, detail, plain losses) of offload for one family."""
    try:
        config = tiny_config(model_type)
        large = too_large(auto, config)
        if large is not None:
            return "not run", large, None
    except Exception as exc:
        return "not built", reason(exc), None
    try:
        torch.manual_seed(0)
        plain = loop(auto.from_config(config), task, config, nullcontext)
    except Exception as exc:
        return "not run", f"the plain loop fails: {reason(exc)}", None
    try:
        torch.manual_seed(0)
        model = auto.from_config(config)
        off = offload(model, policy="save-on-cpu")
        swapped = loop(model, task, config, lambda: off)
        moved = off.stats()["swapped_bytes"]
    except Exception as exc:
        return "fails", reason(exc), plain[0]
    same = plain[0] == swapped[0] and all(
        torch.equal(a, b) for a, b in zip(plain[1], swapped[1], strict=True)
    )
    if not same:
        return "differs", "losses or weights differ from the plain loop", plain[0]
    if moved == 0:
        return "nothing moved", "the plan moved no tensor", plain[0]
    unmatched = off.stats()["unmatched_tensors"]
    varies = f"; the forward varied: {unmatched} tensors kept" if unmatched else ""
    moved_kib = f"{moved / 2**10:.0f} KiB moved per step{varies}; {off.layer_names[0]}, ..."
    return "covered", moved_kib, plain[0]


def reason(exc: BaseException) -> str:
    """The exception's first line, short and fit for a table cell."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text[:160].replace("|", "/")


def main(argv: list[str] | None = None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few families (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    parser.add_argument("--no-pipeline", action="store_true", help="offload only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    signal.signal(signal.SIGALRM, too_long)
    rows = []
    for task, (mapping, auto_name) in MAPPINGS.items():
        auto = getattr(transformers, auto_name)
        for model_type in model_types(mapping, args.quick):
            signal.alarm(TIME_LIMIT_S)
            plain: list[float] | None = None
            try:
                verdict, detail, plain = check(task, model_type, auto)
            except TimeoutError:
                verdict, detail = "not run", f"took more than {TIME_LIMIT_S} s"
            finally:
                signal.alarm(0)
            piped, piped_detail = "-", "the tiny model did not run plainly"
            if plain is not None and not args.no_pipeline:
                piped, piped_detail = check_pipeline(task, model_type, auto_name, plain)
            rows.append((task, model_type, verdict, detail, piped, piped_detail))
            print(rows[-1], flush=True)
    summary = []
    for task in MAPPINGS:
        mine = [r for r in rows if r[0] == task]
        covered = sum(r[2] == "covered" for r in mine)
        piped = sum(r[4] == "covered" for r in mine)
        built = [r for r in mine if r[2] not in ("not built", "not run")]
        if mine:
            summary.append(
                f"| {task} | {len(mine)} | {len(built)} | {covered} ({covered / len(mine):.0%}) | "
                f"{covered}/{len(built)} | {piped} ({piped / len(mine):.0%}) | "
                f"{piped}/{len(built)} |"
            )
    lines = [
        "| task | model types | tiny model ran plainly | offload covers | of those that ran "
        "| 2-stage pipeline covers | of those that ran |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *summary,
        "",
        "| task | model type | offload | detail | pipeline | detail |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    text = (
        header(
            "Hugging Face families through pipeswap.offload and pipeswap.Pipeline",
            "family_coverage.py",
            argv,
        )
        + f"transformers {transformers.__version__}. "
        + "Offload covers a family when 3 steps of the plain loop give bit-identical losses and "
        "weights with every saved activation of the blocks moved to host memory. The "
        'pipeline covers it when `pipeswap.Pipeline(model, stages=2, schedule="gpipe", '
        "micro_batches=2)` in two processes (gloo), fed the same batches with `labels=`, "
        f"gives the plain loop's losses within {PIPELINE_REL:g} (relative) at every step. "
        "'not built' and 'not run': the family's tiny config could not be made or trained "
        "plainly here (the detail says why); they say nothing about pipeswap.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    write_atomic(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
