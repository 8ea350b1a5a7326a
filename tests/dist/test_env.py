"""torchrun's environment variables: read when they fit together, refused by name when not.

Covers: pipeswap/dist/env.py.
"""

from __future__ import annotations

import pytest

from pipeswap.cli import main
from pipeswap.dist.env import torchrun_env
from pipeswap.errors import PipeswapError

_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_FIX = "a stale torchrun environment? unset RANK, WORLD_SIZE"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_consistent_environment_is_read(clean_env: pytest.MonkeyPatch) -> None:
    assert torchrun_env() is None
    for name, value in dict(
        RANK="3",
        WORLD_SIZE="8",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="29400",
    ).items():
        clean_env.setenv(name, value)
    env = torchrun_env()
    assert env is not None
    assert (env.rank, env.world_size, env.local_rank, env.local_ranks) == (3, 8, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29400)


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"RANK": "5", "WORLD_SIZE": "2"},
            "^RANK=5 but WORLD_SIZE=2: a stale torchrun environment\\? unset RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT to launch with nproc$",
        ),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "^RANK=-1 but WORLD_SIZE=2: "),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "^WORLD_SIZE=0, but a job needs at least 1 rank: "),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "^RANK='one' is not a whole number: "),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "^WORLD_SIZE='2.0' is not a whole number: "),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"},
            "^MASTER_PORT='http' is not a whole number: ",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "^MASTER_PORT=70000 is not a TCP port \\(1 to 65535\\): ",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
            "^LOCAL_RANK=2 but LOCAL_WORLD_SIZE=2: .* unset RANK, WORLD_SIZE, LOCAL_RANK, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "3"},
            "^LOCAL_WORLD_SIZE=3 but WORLD_SIZE=2: ",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "x"},
            "^LOCAL_RANK='x' is not a whole number: ",
        ),
    ],
)
def test_a_stale_or_mistyped_environment_is_refused_naming_the_variables(
    clean_env: pytest.MonkeyPatch, values: dict[str, str], message: str
) -> None:
    for name, value in values.items():
        clean_env.setenv(name, value)
    with pytest.raises(PipeswapError, match=message) as info:
        torchrun_env()
    assert _FIX in str(info.value)


def test_train_with_a_stale_environment_exits_2(
    clean_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_env.setenv("RANK", "5")
    clean_env.setenv("WORLD_SIZE", "2")
    argv = [
        "train",
        "--model",
        "gpt2-micro",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--steps",
        "1",
        "--device",
        "cpu",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: RANK=5 but WORLD_SIZE=2: a stale torchrun environment?" in err
    assert "Traceback" not in err
