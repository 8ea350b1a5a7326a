"""Tests of the GPU spec table (pipeswap.hardware.gpus).

Covers: pipeswap/hardware/gpus.py.
"""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import GpuSpec, gpu_names, gpu_spec

GiB = 2**30


def test_names_cover_the_reference_table() -> None:
    assert gpu_names() == ["v100-32gb", "rtx2080ti", "rtx3090", "a100-80gb", "h100-pcie", "h200"]


def test_reference_figures() -> None:
    v100 = gpu_spec("v100-32gb")
    assert (v100.memory_bytes, v100.hbm_bytes_per_s) == (32 * GiB, 900e9)
    assert (v100.fp32_flops, v100.tensor_flops, v100.pcie_gen) == (14e12, 112e12, 3)
    h200 = gpu_spec("h200")
    assert (h200.memory_bytes, h200.hbm_bytes_per_s, h200.tensor_flops) == (
        141 * GiB,
        4.8e12,
        989e12,
    )
    assert gpu_spec("rtx2080ti").memory_bytes == 11 * GiB
    assert gpu_spec("a100-80gb").pcie_gen == 4 and gpu_spec("h100-pcie").pcie_gen == 5


def test_every_spec_is_sane() -> None:
    for name in gpu_names():
        spec = gpu_spec(name)
        assert spec.name == name
        assert spec.tensor_flops > spec.fp32_flops > 0
        assert spec.copy_engines in (1, 2)
        assert GpuSpec.from_json(spec.to_json()) == spec


def test_lookup_is_case_insensitive() -> None:
    assert gpu_spec("H200") is gpu_spec("h200")
    assert gpu_spec(" V100-32GB ") is gpu_spec("v100-32gb")


def test_peak_flops_by_dtype() -> None:
    v100 = gpu_spec("v100-32gb")
    assert v100.peak_flops("float32") == 14e12  # Volta has no TF32
    assert v100.peak_flops("bfloat16") == 112e12


def test_unknown_name_lists_the_specs() -> None:
    with pytest.raises(PipeswapError) as info:
        gpu_spec("a99")
    message = str(info.value)
    assert "'a99'" in message
    for name in gpu_names():
        assert name in message


def test_from_json_refuses_other_formats() -> None:
    with pytest.raises(PipeswapError, match="pipeswap.gpuspec/1"):
        GpuSpec.from_json({"format": "pipeswap.profile/1"})
