"""What the benchmark tests share: run a script's --quick form, read its markdown tables."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def run_quick(script: str, out: Path, *extra: str, timeout: int = 120) -> str:
    before = {p: p.stat().st_mtime_ns for p in RESULTS.glob("*")} if RESULTS.exists() else {}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    after = {p: p.stat().st_mtime_ns for p in RESULTS.glob("*")} if RESULTS.exists() else {}
    assert after == before, "a --quick run must not touch docs/results"
    text = out.read_text()
    assert f"benchmarks/{script} --quick --out {out}" in text  # the command that made it
    assert "Machine: " in text and "Date: " in text
    return text


def rows(text: str, first_header_cell: str) -> list[list[str]]:
    """Rows (cells) of the first markdown table whose header starts with the given cell."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header_cell} |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def number(cell: str) -> float:
    match = re.match(r"^([-+]?[\d,]*\.?\d+)", cell)
    assert match, f"not a number: {cell!r}"
    return float(match.group(1).replace(",", ""))
