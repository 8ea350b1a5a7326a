"""Every command that writes refuses a bad output path before any work, and every command
that reads refuses an unreadable input: exit 2, one line naming the file and the fix, no
traceback, no file written or changed.

Covers: pipeswap/commands/{profile,plan,simulate,schedule,demo,topology}.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeswap.cli import main
from pipeswap.hardware.presets import resolve_topology

OLD = "old contents\n"

# The fix each refusal of check_writable names.
IS_DIRECTORY = "is a directory; give a file name"
PARENT_IS_FILE = "is a file, not a folder; choose another path"
IS_INPUT = "is also an input; write to another file"
TWICE = "give each its own file"


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real profile, made once per module by the CLI (a micro model, estimated)."""
    path = tmp_path_factory.mktemp("profile") / "p.json"
    assert (
        main(
            [
                "profile",
                "--model",
                "gpt2-micro",
                "--batch",
                "2",
                "--seq-len",
                "8",
                "--estimate",
                "--out",
                str(path),
            ]
        )
        == 0
    )
    return path


@pytest.fixture
def work(tmp_path: Path, profile_file: Path, contract_graph: dict) -> Path:
    """A folder with p.json (profile), g.json (graph), topo.json (switch-4), a folder `dir`,
    a plain file `file` and a file `old` whose contents must survive every refusal."""
    (tmp_path / "p.json").write_bytes(profile_file.read_bytes())
    (tmp_path / "g.json").write_text(json.dumps(contract_graph))
    resolve_topology("switch-4").save(tmp_path / "topo.json")
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text(OLD)
    (tmp_path / "old").write_text(OLD)
    return tmp_path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Run ``pipeswap ARGV``; assert it exits 2 with one error line holding every needle."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith(f"pipeswap {argv[0]}: error: "), err
    assert err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for folders)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def plan_argv(w: Path, *extra: str) -> list[str]:
    return [
        "plan",
        "--profile",
        str(w / "p.json"),
        "--topology",
        str(w / "topo.json"),
        "--policy",
        "disjoint",
        *extra,
    ]


def simulate_argv(w: Path, *extra: str) -> list[str]:
    return ["simulate", "--graph", str(w / "g.json"), "--topology", str(w / "topo.json"), *extra]


def profile_argv(w: Path, *extra: str) -> list[str]:
    return [
        "profile",
        "--model",
        "gpt2-micro",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--estimate",
        *extra,
    ]


def schedule_argv(w: Path, *extra: str) -> list[str]:
    return ["schedule", "show", "--schedule", "1f1b", "--stages", "2", *extra]


# (command, argv builder, output option) for every option that names a file to write.
OUTPUTS = [
    ("profile", profile_argv, "--out"),
    ("plan", plan_argv, "--out"),
    ("plan", plan_argv, "--graph-out"),
    ("plan", plan_argv, "--trace"),
    ("plan", plan_argv, "--timeline"),
    ("simulate", simulate_argv, "--trace"),
    ("simulate", simulate_argv, "--timeline"),
    ("schedule", schedule_argv, "--trace"),
]
OUTPUT_IDS = [f"{command}{flag}" for command, _, flag in OUTPUTS]


@pytest.mark.parametrize(("command", "argv", "flag"), OUTPUTS, ids=OUTPUT_IDS)
def test_output_that_is_a_directory_is_refused(work, capsys, command, argv, flag) -> None:
    before = snapshot(work)
    target = str(work / "dir")
    refused(capsys, argv(work, flag, target), target, IS_DIRECTORY)
    assert snapshot(work) == before


@pytest.mark.parametrize(("command", "argv", "flag"), OUTPUTS, ids=OUTPUT_IDS)
def test_output_whose_parent_is_a_file_is_refused(work, capsys, command, argv, flag) -> None:
    before = snapshot(work)
    target = str(work / "file" / "x.json")
    refused(capsys, argv(work, flag, target), target, f"{work / 'file'} {PARENT_IS_FILE}")
    assert snapshot(work) == before
    assert (work / "file").read_text() == OLD


# (command, argv builder, output option, input file it must not overwrite)
SAME_AS_INPUT = [
    ("plan", plan_argv, flag, name)
    for flag in ("--out", "--graph-out", "--trace", "--timeline")
    for name in ("p.json", "topo.json")
] + [
    ("simulate", simulate_argv, flag, name)
    for flag in ("--trace", "--timeline")
    for name in ("g.json", "topo.json")
]


@pytest.mark.parametrize(
    ("command", "argv", "flag", "name"),
    SAME_AS_INPUT,
    ids=[f"{c}{f}={n}" for c, _, f, n in SAME_AS_INPUT],
)
def test_output_that_is_an_input_is_refused(work, capsys, command, argv, flag, name) -> None:
    before = snapshot(work)
    target = str(work / name)
    refused(capsys, argv(work, flag, target), f"output {target} {IS_INPUT}")
    assert snapshot(work) == before


def test_output_that_is_an_input_through_a_symlink_is_refused(work, capsys) -> None:
    link = work / "link.json"
    link.symlink_to(work / "p.json")
    before = snapshot(work)
    refused(capsys, plan_argv(work, "--out", str(link)), str(link), IS_INPUT)
    assert snapshot(work) == before


# (command, argv builder, first option, second option) given the same file.
TWO_OUTPUTS = [
    ("plan", plan_argv, a, b)
    for i, a in enumerate(("--out", "--graph-out", "--trace", "--timeline"))
    for b in ("--out", "--graph-out", "--trace", "--timeline")[i + 1 :]
] + [("simulate", simulate_argv, "--trace", "--timeline")]


@pytest.mark.parametrize(
    ("command", "argv", "first", "second"),
    TWO_OUTPUTS,
    ids=[f"{c}{a}{b}" for c, _, a, b in TWO_OUTPUTS],
)
def test_one_file_given_as_two_outputs_is_refused(
    work, capsys, command, argv, first, second
) -> None:
    before = snapshot(work)
    target = str(work / "old")
    refused(capsys, argv(work, first, target, second, target), target, TWICE)
    assert snapshot(work) == before
    assert (work / "old").read_text() == OLD


@pytest.mark.parametrize("bad", ["--graph-out", "--trace", "--timeline"])
def test_plan_writes_no_output_when_a_later_one_is_refused(work, capsys, bad) -> None:
    """Before: --out was written, then --graph-out (or the trace, the chart) failed."""
    before = snapshot(work)
    refused(
        capsys,
        plan_argv(work, "--out", str(work / "plan.json"), bad, str(work / "dir")),
        str(work / "dir"),
        IS_DIRECTORY,
    )
    assert snapshot(work) == before
    assert not (work / "plan.json").exists()


@pytest.mark.parametrize("flag", ["--out", "--trace"])
def test_empty_output_name_is_refused(work, capsys, flag) -> None:
    argv = profile_argv(work, "--out", "") if flag == "--out" else schedule_argv(work, flag, "")
    refused(capsys, argv, f"{flag} is empty; give a file name")


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (plan_argv, "--trace"),
        (plan_argv, "--timeline"),
        (simulate_argv, "--trace"),
        (simulate_argv, "--timeline"),
    ],
)
def test_a_write_that_fails_after_the_check_names_the_file(
    work, capsys, monkeypatch, argv, flag
) -> None:
    """The late writes (the JSON trace, the PNG chart) go through write_atomic, so an OSError
    still becomes one line naming the file, even when the early check is bypassed."""
    monkeypatch.setattr("pipeswap.jsonio.check_writable", lambda *a, **k: None)
    before = snapshot(work)
    target = str(work / "dir")
    refused(capsys, argv(work, flag, target), target, IS_DIRECTORY)
    assert snapshot(work) == before


def test_schedule_json_also_writes_the_trace(work, capsys) -> None:
    """--json used to skip --trace silently."""
    assert main(schedule_argv(work, "--json", "--trace", str(work / "t.json"))) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout is the JSON alone
    assert "Chrome trace written to" in captured.err
    assert json.loads((work / "t.json").read_text())["traceEvents"]


# ---- demo --out: a folder ------------------------------------------------------------------


def test_demo_out_that_is_a_file_is_refused(work, capsys) -> None:
    before = snapshot(work)
    refused(
        capsys,
        ["demo", "--out", str(work / "file")],
        str(work / "file"),
        "is a file, not a folder; give a folder",
    )
    assert snapshot(work) == before


def test_demo_out_under_a_file_is_refused(work, capsys) -> None:
    before = snapshot(work)
    target = str(work / "file" / "demo")
    refused(
        capsys,
        ["demo", "--out", target],
        f"cannot create folder {target}",
        f"{work / 'file'} is a file, not a folder; choose another --out",
    )
    assert snapshot(work) == before


def test_demo_refuses_a_folder_where_it_writes_a_file(work, capsys) -> None:
    (work / "demo" / "plan.json").mkdir(parents=True)
    before = snapshot(work)
    target = str(work / "demo" / "plan.json")
    refused(capsys, ["demo", "--out", str(work / "demo")], target, IS_DIRECTORY)
    assert snapshot(work) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_demo_out_in_a_read_only_folder_is_refused(work, capsys) -> None:
    (work / "ro").mkdir()
    (work / "ro").chmod(0o500)
    try:
        refused(
            capsys,
            ["demo", "--out", str(work / "ro" / "demo")],
            "permission denied",
            "choose another --out",
        )
        assert not (work / "ro" / "demo").exists()
    finally:
        (work / "ro").chmod(0o700)


# ---- unreadable inputs ---------------------------------------------------------------------

# (argv with INPUT where the input goes); the other inputs are good files.
INPUTS = {
    "plan--profile": lambda w, x: plan_argv(w)[:1] + ["--profile", x] + plan_argv(w)[3:],
    "plan--topology": lambda w, x: plan_argv(w)[:3] + ["--topology", x] + plan_argv(w)[5:],
    "simulate--graph": lambda w, x: ["simulate", "--graph", x, "--topology", "switch-4"],
    "simulate--topology": lambda w, x: ["simulate", "--graph", str(w / "g.json"), "--topology", x],
    "topology-show": lambda w, x: ["topology", "show", x],
}


@pytest.mark.parametrize("case", INPUTS)
def test_input_that_is_a_directory_is_refused(work, capsys, case) -> None:
    target = str(work / "dir")
    err = refused(capsys, INPUTS[case](work, target), f"{target} is a directory; give a")
    assert "JSON file" in err


@pytest.mark.parametrize("case", INPUTS)
@pytest.mark.parametrize("name", ["bad.json", "bad.bin"])
def test_input_that_is_not_utf8_is_refused(work, capsys, case, name) -> None:
    path = work / name
    path.write_bytes(b'{"format": "\xff\xfe"}')
    if case.endswith(("--profile", "--graph")) or name.endswith(".json"):
        refused(
            capsys,
            INPUTS[case](work, str(path)),
            f"{path} is not UTF-8 text",
            "give a JSON file written by pipeswap",
        )
    else:  # a topology not named .json is a file only where it exists: this one does
        refused(capsys, INPUTS[case](work, str(path)), str(path), "not UTF-8")


@pytest.mark.parametrize("case", INPUTS)
def test_missing_input_is_refused(work, capsys, case) -> None:
    target = str(work / "nosuch.json")
    refused(capsys, INPUTS[case](work, target), target)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
@pytest.mark.parametrize("case", INPUTS)
def test_input_without_read_permission_is_refused(work, capsys, case) -> None:
    path = work / "secret.json"
    path.write_text("{}")
    path.chmod(0)
    refused(capsys, INPUTS[case](work, str(path)), f"cannot read {path}: permission denied")
