"""torchrun across nodes: two torchrun launchers (node ranks 0 and 1, over loopback) train
one replicated pipeline whose stages swap, bit for bit as its emulation.

Covers: pipeswap/training/pipeline_parallel.py under a multi-node torchrun (world = stages x
replicas across the nodes; local ranks restart at 0 on each node).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeswap.cli import main
from pipeswap.dist.env import free_port

ARGS = ["--model", "gpt2-micro", "--seq-len", "16", "--batch", "4", "--steps", "3"]
ARGS += ["--pipeline", "2", "--micro-batches", "2", "--device", "cpu"]
ARGS += ["--swap-policy", "save-on-cpu"]


@pytest.mark.slow  # seconds of the fast suite's budget: it runs in `make test-slow`
@pytest.mark.dist
def test_two_torchrun_nodes_train_a_replicated_pipeline_as_its_emulation(tmp_path: Path) -> None:
    port = free_port()
    report = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "pipeswap",
                "train",
                *ARGS,
                "--timeout",
                "60",
                *(["--report", str(report)] if node == 0 else []),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    ran = json.loads(report.read_text())
    assert ran["nproc"] == 4 and ran["train_config"]["pipeline"]["replicas"] == 2
    emulated = tmp_path / "e.json"
    assert main(["train", *ARGS, "--emulate", "--replicas", "2", "--report", str(emulated)]) == 0
    reference = json.loads(emulated.read_text())
    assert ran["losses"] == reference["losses"]
    assert ran["params_sha256"] == reference["params_sha256"]
    assert len(ran["stage_swap"]["measured"]) == 4  # every rank of both nodes swapped
