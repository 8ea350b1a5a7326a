"""`pipeswap plan`: table, JSON, --compare, exported graph reproduced by `pipeswap simulate`."""

from __future__ import annotations

import json

import pytest
from support import toy_profile

from pipeswap.cli import main
from pipeswap.profiling.profile import Profile


@pytest.fixture
def profile_path(tmp_path) -> str:
    path = tmp_path / "p.json"
    toy_profile([(6,)] * 6, 0.25, 0.5).save(path)
    return str(path)


def test_plan_json_and_graph_reproduced_by_simulate(profile_path, tmp_path, capsys) -> None:
    graph, plan = tmp_path / "g.json", tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--profile",
            profile_path,
            "--topology",
            "switch-4",
            "--gpus",
            "2",
            "--footprint-ratio",
            "2",
            "--accumulate",
            "4",
            "--policy",
            "bidirectional",
            "--graph-out",
            str(graph),
            "--out",
            str(plan),
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["policy"] == "bidirectional"
    for key in ("iteration_s", "compute_s", "lower_bound_s", "solve_s", "mip_gap"):
        assert key in result
    for gpu in result["gpus"]:
        assert set(gpu) >= {"peak_bytes", "budget_bytes", "swapped_bytes", "stall_s"}
    reproduce = captured.err.split("reproduce with: ")[1].strip()
    assert reproduce.startswith("pipeswap simulate ")
    assert main(reproduce.split()[1:] + ["--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["makespan_s"] == result["iteration_s"]
    budget = result["budget_bytes"]
    assert all(g["peak_bytes"] <= budget for g in simulated["gpus"].values())
    assert json.loads(plan.read_text())["format"] == "pipeswap.swapplan/2"


def test_compare_prints_one_row_per_policy(profile_path, capsys) -> None:
    code = main(
        [
            "plan",
            "--profile",
            profile_path,
            "--topology",
            "switch-4",
            "--gpus",
            "2",
            "--footprint-ratio",
            "2",
            "--compare",
            "--time-limit",
            "2",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    for policy in (
        "none (no fit)",
        "oblivious",
        "disjoint",
        "bidirectional",
        "recompute",
        "save-on-cpu",
        "hybrid",
        "mip",
        "auto",
    ):
        assert policy in out
    assert "recomputed" in out.splitlines()[0]
    assert "best: " in out


def test_hybrid_plan_round_trips_and_its_graph_reproduces(profile_path, tmp_path, capsys) -> None:
    from pipeswap.swap.plan import SwapPlan

    plan, graph = tmp_path / "plan.json", tmp_path / "graph.json"
    code = main(
        [
            "plan",
            "--profile",
            profile_path,
            "--topology",
            "switch-4",
            "--gpus",
            "2",
            "--footprint-ratio",
            "2",
            "--policy",
            "hybrid",
            "--json",
            "--out",
            str(plan),
            "--graph-out",
            str(graph),
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    loaded = SwapPlan.load(plan)
    assert loaded.policy == "hybrid"
    assert SwapPlan.from_json(loaded.to_json()) == loaded
    recomputed = [g["recomputed_layers"] for g in result["gpus"]]
    assert recomputed == [len(g.recompute) for g in loaded.gpus]
    code = main(
        [
            "simulate",
            "--graph",
            str(graph),
            "--topology",
            "switch-4",
            "--gpu-memory",
            str(result["budget_bytes"]),
            "--json",
        ]
    )
    assert code == 0
    simulated = json.loads(capsys.readouterr().out)
    assert simulated["makespan_s"] == pytest.approx(result["iteration_s"], rel=1e-12)


def test_budget_too_small_exits_2_with_the_smallest_budget(profile_path, capsys) -> None:
    code = main(
        [
            "plan",
            "--profile",
            profile_path,
            "--topology",
            "switch-4",
            "--gpu-memory",
            "1GB",
            "--policy",
            "disjoint",
        ]
    )
    assert code == 2
    assert "smallest budget that works is" in capsys.readouterr().err


def test_profile_without_saved_data_exits_2_with_the_command(tmp_path, capsys) -> None:
    obj = toy_profile([(1,)] * 2).to_json()
    obj["has_saved_data"] = False
    path = tmp_path / "bare.json"
    Profile.from_json(obj).save(path)
    code = main(
        [
            "plan",
            "--profile",
            str(path),
            "--topology",
            "switch-4",
            "--footprint-ratio",
            "1.5",
            "--policy",
            "oblivious",
        ]
    )
    assert code == 2
    assert "the profile command with --model toy, --batch 1, --estimate" in capsys.readouterr().err


@pytest.mark.parametrize("batch", ["0", "-3"])
def test_an_estimate_with_no_samples_exits_2(capsys, batch: str) -> None:
    # Before: --batch 0 planned silently with the model's default batch (exit 0).
    argv = ["plan", "--estimate", "gpt2-tiny", "--batch", batch, "--topology", "switch-4"]
    assert main([*argv, "--policy", "disjoint"]) == 2
    err = capsys.readouterr().err
    assert f"--batch is {batch}; use a whole number >= 1 (or leave it out" in err


def test_policy_or_compare_is_required(profile_path, capsys) -> None:
    assert main(["plan", "--profile", profile_path, "--topology", "switch-4"]) == 2
    assert "--policy NAME" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policy", "mip", "--time-limit", "-1"], "--time-limit is -1.0; use a positive finite"),
        (["--policy", "mip", "--time-limit", "nan"], "--time-limit is nan; use a positive finite"),
        (["--policy", "auto", "--time-limit", "inf"], "--time-limit is inf; use a positive finite"),
        (["--compare", "--time-limit", "0"], "--time-limit is 0.0"),
        (["--policy", "disjoint", "--gpus", "0"], "--gpus is 0; topology 'switch-4' has 4 GPUs"),
        (["--policy", "disjoint", "--gpus", "-1"], "--gpus is -1; topology 'switch-4' has 4 GPUs"),
        (["--policy", "disjoint", "--accumulate", "0"], "--accumulate is 0; use 1 or more"),
        (
            ["--policy", "disjoint", "--footprint-ratio", "0.5"],
            "--footprint-ratio is 0.5; use a ratio >= 1",
        ),
        (
            ["--policy", "disjoint", "--footprint-ratio", "nan"],
            "--footprint-ratio is nan; use a ratio >= 1",
        ),
        (["--policy", "mip", "--compare"], "--policy mip and --compare exclude each other"),
        (["--policy", "disjoint", "--gpu-memory", "lots"], "not a byte size: 'lots'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(profile_path, capsys, extra, message) -> None:
    code = main(["plan", "--profile", profile_path, "--topology", "switch-4", *extra])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_topology_without_gpus_exits_2(profile_path, tmp_path, capsys) -> None:
    path = tmp_path / "cpu-only.json"
    path.write_text(
        json.dumps(
            {
                "format": "pipeswap.topology/1",
                "name": "cpu-only",
                "nodes": [{"id": "cpu0", "kind": "cpu"}],
                "links": [],
            }
        )
    )
    assert (
        main(["plan", "--profile", profile_path, "--topology", str(path), "--policy", "disjoint"])
        == 2
    )
    err = capsys.readouterr().err
    assert "topology 'cpu-only'" in err and "has no GPU; add a node with kind gpu" in err


def test_profile_with_negative_bytes_exits_2_naming_the_layer(tmp_path, capsys) -> None:
    # It used to load, and the planner then blamed the topology's memory.
    obj = toy_profile([(1,)] * 2).to_json()
    obj["layers"][1]["param_bytes"] = -1000
    path = tmp_path / "negative.json"
    path.write_text(json.dumps(obj))
    assert (
        main(["plan", "--profile", str(path), "--topology", "switch-4", "--policy", "disjoint"])
        == 2
    )
    err = capsys.readouterr().err
    assert "layer 1 ('l1'): param_bytes is -1000; write a whole number of bytes" in err
    assert "Traceback" not in err


def test_plan_help_shows_no_default_policy_since_it_asks_for_one(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "hybrid swaps or recomputes --gpu-memory" in text  # no "(default auto)" between


def test_compare_goes_on_past_a_policy_that_refuses_the_budget(
    profile_path, capsys, monkeypatch
) -> None:
    import pipeswap.commands.plan as plan_command
    from pipeswap.swap.plan.refused import BudgetRefused

    real = plan_command.plan_case

    def finer_refuses(case, profile, policy, **kw):  # type: ignore[no-untyped-def]
        if policy == "finer":
            raise BudgetRefused("no plan of policy finer fits", floor=1, peak=2, smallest=None)
        return real(case, profile, policy, **kw)

    monkeypatch.setattr(plan_command, "plan_case", finer_refuses)
    args = ["plan", "--profile", profile_path, "--topology", "switch-4", "--gpus", "2"]
    args += ["--footprint-ratio", "2", "--compare", "--time-limit", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "finer (refused)      no plan of policy finer fits" in out
    assert "best: " in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["refused"] == {"finer": "no plan of policy finer fits"}
    assert "finer" not in [r["policy"] for r in result["policies"]]

    def all_refuse(case, profile, policy, **kw):  # type: ignore[no-untyped-def]
        raise BudgetRefused(f"no plan of policy {policy} fits", floor=1, peak=2, smallest=None)

    monkeypatch.setattr(plan_command, "plan_case", all_refuse)
    assert main(args) == 2
    assert "error: no plan of policy none fits" in capsys.readouterr().err


def test_compare_with_no_fitting_plan_says_so(profile_path, capsys, monkeypatch) -> None:
    import dataclasses

    import pipeswap.commands.plan as plan_command

    real = plan_command.plan_case
    monkeypatch.setattr(
        plan_command,
        "plan_case",
        lambda *a, **kw: dataclasses.replace(real(*a, **kw), fits=False),
    )
    args = ["plan", "--profile", profile_path, "--topology", "switch-4", "--gpus", "2"]
    assert main([*args, "--footprint-ratio", "2", "--compare", "--time-limit", "1"]) == 2
    assert "no policy plans a step that fits" in capsys.readouterr().err


def test_an_estimate_takes_the_sequence_length_and_a_profile_refuses_it(
    profile_path, capsys
) -> None:
    args = ["plan", "--topology", "switch-4", "--policy", "none", "--json"]
    peaks = []
    for seq_len in ("16", "32"):
        assert main([*args, "--estimate", "gpt2-micro", "--seq-len", seq_len]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["gpus"][0]["peak_bytes"])
    assert peaks[0] < peaks[1]  # the activations scale with the tokens
    assert main([*args, "--profile", profile_path, "--seq-len", "16"]) == 2
    assert "--seq-len, --image-size, --gpu and --model apply to --estimate" in (
        capsys.readouterr().err
    )
