"""Resident memory of training on a token file, by the file's size: it must not grow with it.

Run from the repository root:

    .venv/bin/python benchmarks/token_file_memory.py            # 2 MiB, 200 MiB and 2 GiB
    .venv/bin/python benchmarks/token_file_memory.py --quick --out /tmp/t.md   # 1 and 8 MiB

For each size a ``.bin`` file of uint16 tokens (nanoGPT's format, seeded, values below
gpt2-tiny's vocabulary of 256) is written to a temporary folder, and a fresh process runs
`pipeswap train --model gpt2-tiny --data FILE --steps 20` (one data-parallel rank, no
swapping), then reads its own /proc/self/status: the peak resident set (VmHWM) and, at
the end, the anonymous and file-backed parts of the resident set (RssAnon, RssFile).
The file is memory-mapped; its vocabulary check reads it in chunks, and a batch touches
only the windows it takes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import RESULTS_DIR, header

from pipeswap.jsonio import write_atomic

RESULTS = RESULTS_DIR / "token_file_memory.md"
STEPS = 20

_CHILD = """
import sys
from pipeswap.cli import main
status = main(["train", "--model", "gpt2-tiny", "--data", sys.argv[1], "--steps", "{steps}",
               "--swap-policy", "none", "--device", "cpu"])
fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("MEMORY", status, *(fields[k].split()[0] for k in ("VmHWM", "RssAnon", "RssFile")))
"""


def write_tokens(path: Path, mib: int, seed: int = 0) -> None:
    """``mib`` MiB of seeded uint16 tokens below 256, written 64 MiB at a time."""
    rng = np.random.default_rng(seed)
    left = mib * 2**20 // 2
    with path.open("wb") as out:
        while left:
            count = min(left, 2**25)
            rng.integers(0, 256, count, dtype=np.uint16).tofile(out)
            left -= count


def measure(mib: int, folder: Path) -> dict[str, float]:
    path = folder / f"tokens-{mib}.bin"
    write_tokens(path, mib)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD.format(steps=STEPS), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    line = next(x for x in done.stdout.splitlines() if x.startswith("MEMORY"))
    _, status, peak, anon, file = line.split()
    assert status == "0", done.stdout + done.stderr
    path.unlink()
    kib = 1024
    return {
        "mib": mib,
        "tokens": mib * 2**20 // 2,
        "peak": int(peak) * kib,
        "anon": int(anon) * kib,
        "file": int(file) * kib,
        "wall_s": wall,
    }


def table(rows: list[dict[str, float]]) -> str:
    lines = [
        "| file | tokens | peak resident (VmHWM) | anonymous at end | file-backed at end | wall s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mib']:,} MiB | {r['tokens']:,} | {r['peak'] / 2**20:.1f} MiB | "
            f"{r['anon'] / 2**20:.1f} MiB | {r['file'] / 2**20:.1f} MiB | {r['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[2, 200, 2048])
    parser.add_argument("--quick", action="store_true", help="1 and 8 MiB only (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the table")
    args = parser.parse_args(argv)
    sizes = [1, 8] if args.quick else args.sizes_mib
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(mib, Path(folder)) for mib in sizes]
    growth = (rows[-1]["peak"] - rows[0]["peak"]) / 2**20
    text = (
        header(
            "Training on a token file: resident memory by file size", "token_file_memory.py", argv
        )
        + f"`pipeswap train --model gpt2-tiny --data FILE --steps {STEPS} --swap-policy none` "
        "in a fresh process per file (one rank, batch 8, 64 tokens). The file is "
        "memory-mapped; the vocabulary check reads it in 16 Mi-token chunks with ordinary "
        "reads, and each batch touches only its windows' pages.\n\n"
        + table(rows)
        + f"\nFrom {rows[0]['mib']:,} MiB to {rows[-1]['mib']:,} MiB of tokens the peak resident "
        f"set changes by {growth:+.1f} MiB.\n"
    )
    print(text)
    write_atomic(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
