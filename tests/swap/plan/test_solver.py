"""HiGHS's console output never reaches our stdout; it goes to the pipeswap.mip logger.

Covers: pipeswap/swap/plan/solver.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import toy_profile

from pipeswap.profiling.profile import Profile

_BUILD = """
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if sys.argv[1] == "debug" else logging.WARNING)
from pipeswap.swap.plan.solver import quiet_highs
quiet_highs(time_limit_s=1.0)
quiet_highs(time_limit_s=1.0)
print("after")
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # A fresh process: HiGHS prints its banner once per process, at the first solver.
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=True
    )


def test_banner_goes_to_the_logger_not_stdout() -> None:
    quiet = _run("-c", _BUILD, "quiet")
    assert quiet.stdout == "after\n"
    assert "HiGHS" not in quiet.stderr  # the logger stays off by default
    debug = _run("-c", _BUILD, "debug")
    assert debug.stdout == "after\n"
    assert "Running HiGHS" in debug.stderr


# Minutes of the fast suite's budget: it runs in `make test-slow`.
@pytest.mark.slow
def test_plan_json_is_only_json_for_solver_policies(tmp_path: Path) -> None:
    profile: Profile = toy_profile([(3, 3)] * 4)
    path = tmp_path / "profile.json"
    profile.save(path)
    for policy in ("mip", "auto"):
        common = ["--profile", str(path), "--topology", "switch-4", "--footprint-ratio", "1.5"]
        done = _run(
            "-m",
            "pipeswap",
            "plan",
            *common,
            "--swap-policy",
            policy,
            "--time-limit",
            "5",
            "--json",
        )
        assert json.loads(done.stdout)["policy"] == policy
        assert "HiGHS" not in done.stderr
        compared = _run("-m", "pipeswap", "plan", *common, "--compare")
        assert "HiGHS" not in compared.stdout + compared.stderr
