"""Tests of which streams a task occupies (pipeswap.sim.streams)."""

from pipeswap.hardware.presets import preset
from pipeswap.sim.graph import Task
from pipeswap.sim.streams import gpu_streams, task_streams


def test_copy_engines_decide_the_copy_streams() -> None:
    two, one = preset("switch-4"), preset("switch-4", copy_engines=1)
    d2h = Task("o", "d2h", gpu="gpu1", bytes=1)
    h2d = Task("i", "h2d", gpu="gpu1", bytes=1)
    assert task_streams(d2h, two) == [("gpu1", "d2h")]
    assert task_streams(h2d, two) == [("gpu1", "h2d")]
    assert task_streams(d2h, one) == task_streams(h2d, one) == [("gpu1", "copy")]
    assert gpu_streams(two, "gpu0") == ("compute", "h2d", "d2h", "comm")
    assert gpu_streams(one, "gpu0") == ("compute", "copy", "comm")


def test_communication_occupies_every_participant() -> None:
    topo = preset("switch-4")
    assert task_streams(Task("c", "compute", gpu="gpu2", duration_s=1), topo) == [
        ("gpu2", "compute")
    ]
    assert task_streams(Task("s", "p2p", src="gpu0", dst="gpu3", bytes=1), topo) == [
        ("gpu0", "comm"),
        ("gpu3", "comm"),
    ]
    assert task_streams(Task("a", "allreduce", gpus=("gpu1", "gpu2"), bytes=1), topo) == [
        ("gpu1", "comm"),
        ("gpu2", "comm"),
    ]
