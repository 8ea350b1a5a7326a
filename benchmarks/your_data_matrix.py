"""Your model, your data, every mode: trained, saved, reloaded with from_pretrained, scored.

Run from the repository root:

    .venv/bin/python benchmarks/your_data_matrix.py                  # every format and mode
    .venv/bin/python benchmarks/your_data_matrix.py --quick --out /tmp/m.md   # a corner of it

Two Hugging Face language-model directories that carry their own tokenizer (a Llama and a
GPT-2, built here from configs with a BPE tokenizer trained on the corpus: nothing is
downloaded) train on one corpus written in every format `--data` reads: a `.txt` file, a
folder of them, JSON lines, CSV, Parquet, Arrow, a `save_to_disk` directory, and the
corpus tokenized by the model's tokenizer as `.bin` (uint16) and `.npy` (int32); a
Hugging Face ViT directory trains on a folder of class folders. Each runs
`pipeswap train ... --steps 3 --save OUT` in four modes: data parallel on 2 ranks without
swapping and with the hybrid policy at footprint ratio 1.3, and a 2-stage 1F1B pipeline
in processes and emulated. The saved directory is loaded with `AutoModelFor...
.from_pretrained(OUT, local_files_only=True)` alone, in eval mode, and scores the same
held-out batches as the run (the last 5% of the data; 2 batches of 4 per rank); the
table gives both losses and their relative difference (fp32).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import RESULTS_DIR, header

from pipeswap.commands.demo_model import make_demo_model
from pipeswap.data import dataset_for
from pipeswap.jsonio import write_atomic

RESULTS = RESULTS_DIR / "your_data_matrix.md"
MODES = {
    "data parallel x2": ["--nproc", "2", "--swap-policy", "none"],
    "data parallel x2, swapping": [
        "--nproc",
        "2",
        "--swap-policy",
        "hybrid",
        "--footprint-ratio",
        "1.3",
    ],
    "pipeline x2": ["--pipeline", "2", "--schedule", "1f1b"],
    "pipeline x2, emulated": ["--pipeline", "2", "--schedule", "1f1b", "--emulate"],
}
EVAL_BATCHES, BATCH, SEQ = 2, 4, 32


def language_models(out: Path) -> tuple[dict[str, Path], list[str]]:
    """A Llama and a GPT-2 directory sharing one trained BPE tokenizer, and the corpus."""
    import transformers

    corpus, llama = make_demo_model(out)
    documents = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(llama, local_files_only=True)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=4,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    gpt2 = out / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(gpt2)
    tokenizer.save_pretrained(gpt2)
    return {"Llama": llama, "GPT-2": gpt2}, documents


def formats(documents: list[str], tokenizer_dir: Path, out: Path) -> dict[str, Path]:
    """The corpus in every format --data reads."""
    import datasets
    import transformers

    out.mkdir(parents=True)
    table = datasets.Dataset.from_dict({"text": documents})
    paths = {
        ".txt": out / "corpus.txt",
        "folder of .txt": out / "texts",
        ".jsonl": out / "corpus.jsonl",
        ".csv": out / "corpus.csv",
        ".parquet": out / "corpus.parquet",
        ".arrow": out / "arrow",
        "save_to_disk": out / "saved",
        ".bin (uint16)": out / "tokens.bin",
        ".npy (int32)": out / "tokens.npy",
    }
    paths[".txt"].write_text("\n\n".join(documents))
    paths["folder of .txt"].mkdir()
    for i, doc in enumerate(documents):
        (paths["folder of .txt"] / f"{i:04d}.txt").write_text(doc)
    paths[".jsonl"].write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    table.to_csv(str(paths[".csv"]), index=False)
    table.to_parquet(str(paths[".parquet"]))
    table.save_to_disk(str(paths["save_to_disk"]))
    arrow = next(paths["save_to_disk"].glob("*.arrow"))
    paths[".arrow"] = arrow
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    ids: list[int] = []
    for doc in documents:
        ids += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
    np.asarray(ids, dtype=np.uint16).tofile(paths[".bin (uint16)"])
    np.save(paths[".npy (int32)"], np.asarray(ids, dtype=np.int32))
    return paths


def image_model(out: Path) -> tuple[Path, Path]:
    """A small Hugging Face ViT directory and a folder of 3 classes of coloured images."""
    import transformers
    from PIL import Image

    config = transformers.ViTConfig(
        image_size=64,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    torch.manual_seed(0)
    vit = out / "vit"
    transformers.ViTForImageClassification(config).save_pretrained(vit)
    folder = out / "images"
    for label, name in enumerate(("red", "green", "blue")):
        (folder / name).mkdir(parents=True)
        for i in range(60):
            pixels = np.full((28 + i % 5, 30, 3), 40, dtype=np.uint8)
            pixels[..., label] = 200 + i % 40
            Image.fromarray(pixels).save(folder / name / f"{i:03d}.png")
    return vit, folder


def reloaded_loss(kind: str, saved: Path, source: str, data: Path, ranks: int) -> float:
    """The held-out loss of the saved directory, on the run's held-out batches."""
    import transformers

    auto = (
        transformers.AutoModelForImageClassification
        if kind == "image"
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_pretrained(saved, local_files_only=True).eval()
    held = dataset_for(
        source, seq_len=SEQ if kind == "lm" else None, split="val", data=(str(data), "text", "val")
    )
    losses = []
    with torch.no_grad():
        for index in range(EVAL_BATCHES * ranks):
            inputs, targets = held.batch(BATCH, index)
            if kind == "image":
                logits = model(pixel_values=inputs).logits
                losses.append(torch.nn.functional.cross_entropy(logits, targets))
            else:
                logits = model(input_ids=inputs).logits
                losses.append(
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
                )
    return float(sum(losses) / len(losses))


def run_one(kind: str, model: Path, data: Path, mode: list[str], out: Path) -> dict[str, Any]:
    report, saved = out / "report.json", out / "saved"
    argv = ["train", "--model", str(model), "--batch", str(BATCH), "--steps", "3"]
    argv += ["--data", str(data), "--eval-batches", str(EVAL_BATCHES), "--save", str(saved)]
    argv += ["--report", str(report), "--device", "cpu", *mode]
    if kind == "lm":
        argv += ["--seq-len", str(SEQ)]
    done = subprocess.run(
        [sys.executable, "-m", "pipeswap", *argv], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    stated = json.loads(report.read_text())
    ranks = 2 if "--nproc" in mode else 1
    reloaded = reloaded_loss(kind, saved, str(model), data, ranks)
    return {
        "losses": stated["losses"],
        "stated": stated["eval"]["loss"],
        "reloaded": reloaded,
        "rel": abs(reloaded - stated["eval"]["loss"]) / abs(stated["eval"]["loss"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the Llama, 2 formats, 2 modes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        models, documents = language_models(root / "models")
        data = formats(documents, models["Llama"], root / "data")
        cases: list[tuple[str, str, Path, str, Path]] = [
            ("lm", name, path, fmt, data[fmt]) for name, path in models.items() for fmt in data
        ]
        vit, images = image_model(root / "vit")
        cases.append(("image", "ViT", vit, "folder of class folders", images))
        modes = dict(MODES)
        if args.quick:
            cases = [c for c in cases if c[1] == "Llama" and c[3] in (".jsonl", ".bin (uint16)")]
            modes = {k: MODES[k] for k in ("data parallel x2, swapping", "pipeline x2")}
        for n, (kind, name, model, fmt, path) in enumerate(cases):
            for mode, flags in modes.items():
                out = root / "runs" / f"{n}-{len(rows)}"
                out.mkdir(parents=True)
                result = run_one(kind, model, path, flags, out)
                rows.append({"model": name, "format": fmt, "mode": mode, **result})
                print(rows[-1], flush=True)
    worst = max((r["rel"] for r in rows if "rel" in r), default=float("nan"))
    failed = [r for r in rows if "error" in r]
    lines = [
        "| model | data | mode | loss, first -> last step | held-out loss, report | "
        "reloaded with from_pretrained | relative difference |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['format']} | {r['mode']} | failed: {r['error']} | | | |"
            )
            continue
        lines.append(
            f"| {r['model']} | {r['format']} | {r['mode']} | {r['losses'][0]:.4f} -> "
            f"{r['losses'][-1]:.4f} | {r['stated']:.6f} | {r['reloaded']:.6f} | {r['rel']:.1e} |"
        )
    text = (
        header(
            "Your model and your data in every mode: saved, reloaded, scored",
            "your_data_matrix.py",
            argv,
        )
        + f"{len(rows)} runs, {len(failed)} failed; the largest relative difference between "
        f"the report's held-out loss and the reloaded model's is {worst:.1e}.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    print(text)
    write_atomic(args.out, text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
