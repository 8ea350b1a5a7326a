"""Your Hugging Face causal LM as a 2-stage pipeline, in your own torchrun script and loop.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py MODEL_DIR TOKENS.npy \\
        --schedule 1f1b --out trained/

MODEL_DIR is a directory ``save_pretrained`` wrote; TOKENS.npy a 1-D array of token ids
(your corpus, tokenized). The loop is a plain one: a DataLoader over fixed windows, the
labels as the model takes them, AdamW. Rank 0 saves the trained model with
``save_pretrained`` and writes the losses to ``--out``/losses.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

import pipeswap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a Hugging Face model directory")
    parser.add_argument("tokens", help="a .npy file of token ids")
    parser.add_argument("--out", required=True, help="where rank 0 saves the trained model")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--weights", default="stale")
    parser.add_argument("--micro-batches", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--balance", default=None, help="layers per stage, e.g. 2,2")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    tokens = torch.from_numpy(np.load(args.tokens).astype(np.int64))
    windows = tokens[: len(tokens) // args.seq_len * args.seq_len].view(-1, args.seq_len)
    loader = torch.utils.data.DataLoader(
        windows,
        batch_size=args.batch,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),  # the same batches on every rank
    )

    pipe = pipeswap.Pipeline(
        model,
        stages=2,
        steps=len(loader),
        schedule=args.schedule,
        weights=args.weights,
        micro_batches=args.micro_batches,
        balance=tuple(int(n) for n in args.balance.split(",")) if args.balance else None,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0),
    )
    losses = []
    for batch in loader:
        loss = pipe.step(batch, labels=batch)  # the loss on the last stage, None elsewhere
        if loss is not None:
            losses.append(loss)
    held_out = pipe.eval(windows[: args.batch], labels=windows[: args.batch])
    state = pipe.state_dict()  # the whole model's weights, on rank 0
    if pipe.is_last:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "losses.json", "w") as file:
            json.dump({"losses": losses, "held_out": held_out}, file)
    if state is not None:
        model.save_pretrained(args.out)  # rank 0's model holds every stage's weights
    pipe.close()


if __name__ == "__main__":
    main()
