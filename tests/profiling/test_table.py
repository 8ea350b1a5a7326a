"""Tests of the readable profile table (pipeswap.profiling.table)."""

from support import toy_layer, toy_profile_of

from pipeswap.hardware.gpus import gpu_spec
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.table import fit_warning, format_profile

MiB, GiB = 2**20, 2**30


def _profile(saved_bytes: int = 3 * MiB) -> Profile:
    embed = toy_layer("embed", 0.001, 0.002, param_bytes=2 * MiB, output_bytes=MiB, saved=[MiB])
    block = toy_layer(
        "block0",
        0.0105,
        0.021,
        param_bytes=4 * MiB,
        output_bytes=MiB,
        saved=[saved_bytes],
        workspace_bytes=MiB,
    )
    return toy_profile_of(
        (embed, block),
        batch=4,
        device="v100-32gb",
        optimizer="adam",
        optimizer_state_bytes=12 * MiB,
        seq_len=8,
    )


def test_table_rows_and_totals() -> None:
    lines = format_profile(_profile()).splitlines()
    assert lines[0] == "toy, batch 4, seq_len 8, float32, estimated for v100-32gb, optimizer adam"
    assert lines[1].split() == [
        "layer",
        "fwd",
        "ms",
        "bwd",
        "ms",
        "params",
        "MiB",
        "saved",
        "MiB",
        "output",
        "MiB",
    ]
    assert lines[3].split() == ["embed", "1.000", "2.000", "2.00", "1.00", "1.00"]
    assert lines[4].split() == ["block0", "10.500", "21.000", "4.00", "3.00", "1.00"]
    assert lines[6].split() == ["total", "11.500", "23.000", "6.00", "4.00", "2.00"]
    # resident 2 * 6 + 12 = 24 MiB; peak 24 + 4 saved + (1 workspace + 1 output) = 30 MiB.
    assert "resident (parameters, gradients, adam state): 24.00 MiB" in lines
    assert lines[8].startswith("peak memory of one training step") and "30.00 MiB" in lines[8]
    assert len(lines) == 9  # no GPU line without a spec


def test_columns_line_up() -> None:
    lines = format_profile(_profile()).splitlines()
    widths = {len(line) for line in lines[1:7]}
    assert len(widths) == 1


def test_gpu_verdict_and_warning() -> None:
    v100 = gpu_spec("v100-32gb")
    fits = _profile()
    assert format_profile(fits, v100).splitlines()[-1] == (
        "GPU v100-32gb: 32.00 GiB memory; the step fits"
    )
    assert fit_warning(fits, v100) is None
    big = _profile(saved_bytes=40 * GiB)
    assert format_profile(big, v100).endswith("the step does NOT fit")
    warning = fit_warning(big, v100)
    assert warning is not None
    needed = big.peak_training_bytes() / GiB
    assert f"needs {needed:.2f} GiB but a v100-32gb has 32.00 GiB" in warning
