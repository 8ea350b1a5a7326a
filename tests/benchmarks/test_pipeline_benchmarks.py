"""The pipeline benchmarks' quick modes run and write well-formed tables (not to docs/results)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import RESULTS, ROOT
from bench_support import number as _number
from bench_support import rows as _rows
from bench_support import run_quick as _run


def test_simulated_throughput_table(tmp_path: Path) -> None:
    text = _run("pipeline_throughput_sim.py", tmp_path / "sim.md")
    rows = _rows(text, "model")
    assert [r[:3] for r in rows] == [["vgg16", "v100-32gb", "switch-4"]]
    # 1 GPU, DP, DP no overlap, gpipe, 1f1b, async-1f1b, 2bw: finite positive samples/s.
    rates = [_number(c) for c in rows[0][5:12]]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    single, dp, _, gpipe, one_f_one_b, asynchronous, two_bw = rates
    # Four GPUs never beat four times one GPU; no bubble beats a flush every step.
    assert max(dp, gpipe, one_f_one_b, asynchronous, two_bw) <= 4 * single * 1.0001
    assert asynchronous > one_f_one_b
    # 2bw drops 1f1b's flush (same micro-batches, same global batch).
    assert two_bw > one_f_one_b
    assert len(_rows(text, "server")) == 2
    assert "8.91x" in text and "15.77x" in text


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
@pytest.mark.dist
def test_cpu_throughput_table(tmp_path: Path) -> None:
    text = _run("pipeline_throughput_cpu.py", tmp_path / "cpu.md", timeout=300)
    rows = _rows(text, "variant")
    names = [r[0] for r in rows]
    assert names[:2] == ["ours async-1f1b + spectrain", "ours async-1f1b (stale)"]
    assert {"ours 1f1b", "torch Schedule1F1B", "torch ScheduleGPipe"} <= set(names)
    assert {"pipeswap.Pipeline 1f1b", "pipeswap.Pipeline async-1f1b + spectrain"} <= set(names)
    assert "single process, 1 thread" in names
    for row in rows:
        assert _number(row[1]) > 0 and math.isfinite(_number(row[3]))
    reference = next(r for r in rows if r[0] == "single process, 1 thread")
    assert _number(reference[3]) == 1.0


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
@pytest.mark.dist
def test_user_loop_table_runs_a_user_s_script_under_torchrun(tmp_path: Path) -> None:
    text = _run("pipeline_user_loop.py", tmp_path / "loop.md", timeout=300)
    rows = _rows(text, "variant")
    assert [r[0] for r in rows] == [
        "pipeswap.Pipeline 1f1b",
        "pipeswap.Pipeline 1f1b, its own cut",
        "torch Schedule1F1B",
    ]
    for row in rows:
        assert _number(row[1]) > 0 and math.isfinite(_number(row[3]))
    assert _number(rows[-1][3]) == 1.0
    assert "1 intra-op thread, as torchrun sets" in text and "the hand-written stages" in text


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_convergence_table_and_plots(tmp_path: Path) -> None:
    text = _run("pipeline_convergence.py", tmp_path / "conv.md", "--jobs", "1")
    overview = _rows(text, "setting")
    assert [r[0] for r in overview] == [
        "image, K = 4",
        "lm, K = 4",
        "image, K = 4, official SpecTrain distances",
        "lm, K = 4, official SpecTrain distances",
        "lm, K = 4, lr warm-up over 1 step",
    ]
    for key in ("image_k4", "lm_k4", "lm_k4_official", "lm_k4_warmup1"):
        assert (tmp_path / f"pipeline_convergence_{key}.png").stat().st_size > 1000
    table = _rows(text, "optimizer")  # the first setting's table: 8 modes
    assert [(r[0], r[1]) for r in table] == [
        ("sgd", "sync 1f1b"),
        ("sgd", "stale"),
        ("sgd", "stash"),
        ("sgd", "spectrain"),
        ("adam", "sync 1f1b"),
        ("adam", "stale"),
        ("adam", "stash"),
        ("adam", "predict-adam"),
    ]
    for row in table:
        assert math.isfinite(_number(row[3])) and _number(row[3]) > 0
    # The official-distance setting retrains only the predicting rows; the others are the
    # schedule twin's runs, so its sync and stale cells equal the twin's.
    sections = text.split("### ")
    twin = next(p for p in sections if p.startswith("lm, K = 4\n"))
    official = next(p for p in sections if p.startswith("lm, K = 4, official"))
    for label in ("sync 1f1b", "stale"):
        pick = [line for line in twin.splitlines() if f"| {label} |" in line]
        assert pick and pick == [line for line in official.splitlines() if f"| {label} |" in line]
    delays = _rows(text, "gradient delay")  # the first delay table (lm: 7 patterns)
    assert delays[0][0] == "none (the sync 1f1b runs)" and len(delays) == 7
    # The stash pipeline's delays come from the schedule (steady state, even in 2 steps);
    # the loop with them is that pipeline, so its loss cells equal the stash rows'.
    assert delays[1][0] == "async-1f1b (stash): stages by 3,2,1,0"
    assert [delays[1][1], delays[1][3]] == [
        r[3] for r in _rows(twin, "optimizer") if r[1] == "stash"
    ]
    assert [delays[0][2], delays[1][2], delays[1][4]] == ["0%", "100%", "100%"]
    assert text.count("bit for bit, as the `stash` pipeline in 2 of 2 runs") == 2  # both tasks
    # Interpretation lives in the hand-written notes; the page links to them.
    assert "](pipeline_convergence_notes.md)" in text
    assert (RESULTS / "pipeline_convergence_notes.md").exists()


@pytest.mark.slow  # 18 s of `make test`'s 15 minutes: the --quick page itself is tested above
def test_convergence_page_rebuilds_from_saved_records(tmp_path: Path) -> None:
    """--save-records keeps every run; --load-records renders the same page without training."""
    first, records = tmp_path / "a" / "conv.md", tmp_path / "runs.json"
    _run("pipeline_convergence.py", first, "--jobs", "1", "--save-records", str(records))
    again = tmp_path / "b" / "conv.md"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "pipeline_convergence.py"),
            "--quick",
            "--jobs",
            "1",
            "--out",
            str(again),
            "--load-records",
            str(records),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "[1/" not in done.stdout  # nothing trained
    assert again.read_text() == first.read_text()  # the command shown is the one that trained
    assert (again.parent / "pipeline_convergence_lm_k4.png").stat().st_size > 1000


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stash_is_a_one_step_delayed_gradient(optimizer: str) -> None:
    """The convergence table's async penalty is real: a 2-stage stash pipeline equals a loop,
    written without the pipeline code, whose first half takes its gradient at the weights
    from before the last update."""
    import copy

    import torch
    from support import pipeline_run

    from pipeswap.dist.group import single_threaded
    from pipeswap.pipeline.emulator import Emulator
    from pipeswap.pipeline.job import BatchSource, build_full_model

    config = pipeline_run(
        "tests.pipeline.pipeline_toys:gpt2_micro_untied",
        (2, 2),
        schedule="async-1f1b",
        weights="stash",
        optimizer=optimizer,
        lr=0.05 if optimizer == "sgd" else 1e-3,
        batch=4,
        steps=6,
        seq_len=16,
        eval_batches=0,
    )
    emulated = Emulator(config, record=False).run().losses
    with single_threaded():
        model = build_full_model(config)
        data = BatchSource(config, model)
        front, back = model.stage(0, 2), model.stage(2, 4)
        stale_front = copy.deepcopy(front)  # the weights before the last update

        def make(params: object) -> torch.optim.Optimizer:
            if optimizer == "sgd":
                return torch.optim.SGD(params, lr=config.optim.base_lr, momentum=0.9, foreach=False)  # type: ignore[arg-type]
            return torch.optim.Adam(params, lr=config.optim.base_lr, foreach=False)  # type: ignore[arg-type]

        optimizers = [make(front.parameters()), make(back.parameters())]
        losses = []
        for step in range(config.steps):
            x, y = data.batch(step)
            hidden = stale_front(x)
            received = hidden.detach().requires_grad_(True)
            loss = model.loss(back(received), y)
            loss.backward()
            hidden.backward(received.grad)
            for live, stale in zip(front.parameters(), stale_front.parameters()):
                live.grad, stale.grad = stale.grad, None
            stale_front.load_state_dict(front.state_dict())
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    assert list(emulated) == losses


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_modes_quick_table_has_every_mode_its_memory_and_a_verdict(tmp_path: Path) -> None:
    text = _run("pipeline_modes.py", tmp_path / "modes.md", "--jobs", "1")
    for label in (
        "sync 1f1b",
        "stale",
        "stash",
        "spectrain",
        "predict-adam",
        "2bw stash",
        "2bw spectrain",
        "2bw predict-adam",
        "nesterov",
    ):
        assert f"| {label} |" in text, label
    assert "## Best no-flush mode per setting" in text and "Command: `" in text
    # Weight copies per stage at K = 4: stash keeps N - 1 = 3 versions, 2bw one.
    rows = [line for line in text.splitlines() if " ± " in line]
    assert any(r.startswith("| sgd | stash |") and r.endswith("| 3 |") for r in rows)
    assert any(r.startswith("| sgd | 2bw stash |") and r.endswith("| 1 |") for r in rows)
    assert (tmp_path / "modes_lm_k4.png").stat().st_size > 1000


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
def test_token_file_memory_quick(tmp_path: Path) -> None:
    text = _run("token_file_memory.py", tmp_path / "memory.md", timeout=240)
    rows = _rows(text, "file")
    assert [r[0] for r in rows] == ["1 MiB", "8 MiB"]
    assert all(float(r[2].split()[0]) > 0 for r in rows)


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
def test_offload_cost_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    text = _run("offload_cost.py", tmp_path / "offload.md", timeout=240)
    rows = _rows(text, "variant")
    assert [r[0] for r in rows][:3] == [
        "the loop alone",
        "offload, nothing to move",
        "save_on_cpu (PyTorch)",
    ]
    assert rows[0][4] == "1.000x" and rows[1][5] == "0.00 MiB"  # a plan that moves nothing
    assert float(rows[3][5].split()[0]) > 0  # the save-on-cpu policy moved the blocks' tensors


@pytest.mark.slow
def test_your_data_matrix_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    text = _run("your_data_matrix.py", tmp_path / "matrix.md", timeout=600)
    rows = _rows(text, "model")
    assert len(rows) == 4 and all(float(r[6]) <= 1e-5 for r in rows)


@pytest.mark.slow
def test_family_coverage_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    text = _run("family_coverage.py", tmp_path / "families.md", timeout=240)
    summary = _rows(text, "task")
    assert [r[0] for r in summary] == [
        "causal LM",
        "masked LM",
        "sequence classification",
        "image classification",
    ]
    rows = _rows(text, "task | model type")
    assert all(r[2] == "covered" for r in rows), rows
    assert all(r[4] == "covered" for r in rows), rows  # the 2-stage pipeline column


@pytest.mark.slow
def test_predictions_table(tmp_path: Path) -> None:
    text = _run("predictions.py", tmp_path / "p.md", timeout=600)
    rows = _rows(text, "model")
    assert {(r[1], r[2]) for r in rows} == {
        ("1", "none"),
        ("1", "hybrid"),
        ("2", "none"),
        ("2", "hybrid"),
        ("2", "pipeline 1f1b"),
    }
    for row in rows[:-1]:
        measured, predicted = _number(row[3]), _number(row[4])
        assert measured > 0 and predicted > 0
        stated = float(row[5].rstrip("%")) / 100
        assert stated == pytest.approx((predicted - measured) / measured, abs=0.02)
    assert '"measured": true' in text and "median" in text
