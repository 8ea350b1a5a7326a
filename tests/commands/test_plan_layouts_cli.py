"""`pipeswap plan --layouts`: the best layout, each family's fastest, the flags, the files."""

from __future__ import annotations

import argparse
import json

import pytest
from support import GB, toy_profile

from pipeswap.cli import main
from pipeswap.layouts.layout import Layout


@pytest.fixture
def heavy_profile(tmp_path) -> str:
    path = tmp_path / "p.json"
    # 8 GB of weights: data parallelism cannot hold them on a 10 GB GPU.
    toy_profile([(1.0,)] * 8, param_bytes=GB).save(path)
    return str(path)


def test_layouts_print_the_best_its_flags_and_write_what_reproduces_it(
    heavy_profile, tmp_path, capsys
) -> None:
    layout_path, graph = tmp_path / "layout.json", tmp_path / "g.json"
    args = ["plan", "--profile", heavy_profile, "--topology", "switch-4", "--gpu-memory", "10GB"]
    extra = ["--layouts", "--layout-out", str(layout_path), "--graph-out", str(graph)]
    extra += ["--trace", str(tmp_path / "t.json")]
    assert main(args + extra) == 0
    out = capsys.readouterr().out
    assert "best: pp" in out and "run it: pipeswap train --model toy" in out
    assert "data parallel + swap/recompute" in out and "none fits" in out
    # The runtime runs stages that swap: the flags say how, and no note says otherwise.
    assert "--swap-policy hybrid --gpu-memory" in out and "note: " not in out
    assert json.loads((tmp_path / "t.json").read_text())  # a Chrome trace of the best
    layout = Layout.load(layout_path)
    assert f"--pipeline {layout.stages}" in out and f"--nproc {layout.gpus}" in out
    reproduce = out.split("reproduce with: ")[1].strip().split()
    assert main(reproduce[1:] + ["--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["makespan_s"] == layout.graph_s
    assert max(g["peak_bytes"] for g in simulated["gpus"].values()) == layout.peak_bytes


def test_layouts_json_names_every_family_that_fits(heavy_profile, capsys) -> None:
    args = ["plan", "--profile", heavy_profile, "--topology", "switch-4", "--gpu-memory", "10GB"]
    assert main(args + ["--layouts", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["best"]["format"] == "pipeswap.layout/1"
    assert "data-parallel" not in result["families"]
    best = result["best"]["samples_per_s"]
    assert all(f["samples_per_s"] <= best for f in result["families"].values())


def test_a_budget_nothing_fits_exits_2_naming_the_smallest(heavy_profile, capsys) -> None:
    args = ["plan", "--profile", heavy_profile, "--topology", "switch-4", "--gpu-memory", "1GB"]
    assert main(args + ["--layouts"]) == 2
    err = capsys.readouterr().err
    assert "smallest budget that works" in err and "--gpu-memory" in err


def test_layout_options_need_layouts_and_exclude_the_swap_planners(heavy_profile, capsys) -> None:
    args = ["plan", "--profile", heavy_profile, "--topology", "switch-4"]
    assert main(args + ["--layout-out", "x.json", "--policy", "disjoint"]) == 2
    assert "add --layouts" in capsys.readouterr().err
    assert main(args + ["--layouts", "--policy", "disjoint"]) == 2
    assert "drop --policy" in capsys.readouterr().err
    assert main(["plan", "--topology", "switch-4", "--layouts"]) == 2
    assert "--estimate MODEL" in capsys.readouterr().err
    assert main(args + ["--layouts", "--footprint-ratio", "1.5"]) == 2
    assert "give --gpu-memory SIZE" in capsys.readouterr().err
    assert main(args + ["--layouts", "--gpus", "2"]) == 2
    assert "drop --gpus" in capsys.readouterr().err


@pytest.mark.slow  # 20 s: make test-slow (make test's time)
def test_gpt2_xl_on_single_root_8_at_5_gib_fits_only_as_stages_that_swap(capsys) -> None:
    # 5 GiB per GPU: data parallelism needs 19 GiB for gpt2-xl's weights, gradients,
    # momentum and its largest working set; the best pure pipeline (8 stages, 32
    # micro-batches of one sample) peaks at 5.8 GiB. Stages that swap fit.
    args = ["plan", "--estimate", "gpt2-xl", "--batch", "4", "--gpu", "v100-32gb"]
    args += ["--topology", "single-root-8", "--gpu-memory", "5GiB", "--layouts", "--json"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert "data-parallel" not in result["families"] and "pipeline" not in result["families"]
    best = result["best"]
    assert best["family"] in ("pipeline-swap", "pipeline-dp")
    assert best["peak_bytes"] <= 5 * 2**30 == best["budget_bytes"]
    assert any(p["swapped"] or p["recomputed"] for p in best["stage_plans"])
    assert best["samples_per_s"] > 0


def test_the_flags_of_a_pipeline_x_data_parallel_layout_run_d_replicas() -> None:
    """The printed command is what `pipeswap train` takes: K stages on K x D ranks is D
    replicas of the pipeline, each on the layout's mini-batch."""
    from pipeswap.commands.plan_layouts import train_command
    from pipeswap.commands.train import config_from_args
    from pipeswap.hardware.presets import preset
    from pipeswap.layouts.layout import PIPELINE_DP
    from pipeswap.layouts.search import search_layouts
    from pipeswap.pipeline.resolve import resolve_pipeline

    profile = toy_profile([(1.0,)] * 8, param_bytes=GB // 4)
    search = search_layouts(profile, preset("switch-4"), 10 * GB)
    plain = [s.layout for s in search.scored if s.layout.family == PIPELINE_DP]
    plain = [layout for layout in plain if not layout.swaps]
    assert plain and plain[0].replicas > 1
    layout = plain[0]
    words = train_command(layout, profile).split()
    assert words[:2] == ["pipeswap", "train"]
    # The toy's layers are not a model to build: run gpt2-micro at the layout's shape.
    cut = words.index("--balance")
    words = words[:cut] + words[cut + 2 :]
    words[words.index("--model") + 1] = "gpt2-micro"
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers()
    from pipeswap.commands import train as train_command_module

    train_command_module.register(commands)
    config = config_from_args(parser.parse_args(words[1:]))
    pipeline = config.require_pipeline()
    assert (pipeline.num_stages, config.nproc) == (layout.stages, layout.gpus)
    assert config.batch == layout.samples_per_step // layout.replicas
    assert resolve_pipeline(config).require_pipeline().replicas == layout.replicas
