"""GPU datasheet figures (memory, bandwidth, peak FLOP/s, PCIe, copy engines) by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeswap.errors import PipeswapError

__all__ = ["GPU_SPEC_FORMAT", "GpuSpec", "gpu_names", "gpu_spec"]

GPU_SPEC_FORMAT = "pipeswap.gpuspec/1"

_GiB = 1024**3


@dataclass(frozen=True)
class GpuSpec:
    """Peak figures of one GPU model (dense, no sparsity).

    ``memory_bytes`` is the on-board memory (binary GiB, as the cards report it);
    ``hbm_bytes_per_s`` the device-memory bandwidth; ``fp32_flops`` the FP32 peak (no
    TF32); ``tensor_flops`` the FP16/BF16 tensor-core peak with FP32 accumulation;
    ``pcie_gen`` the PCIe generation of its x16 link; ``copy_engines`` 2 when host-to-device
    and device-to-host copies can run at the same time, 1 when they serialize.
    """

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    fp32_flops: float
    tensor_flops: float
    pcie_gen: int
    copy_engines: int = 2

    def peak_flops(self, dtype: str) -> float:
        """Peak matrix FLOP/s for ``dtype``: tensor cores for 16-bit types, FP32 otherwise."""
        if dtype in ("bfloat16", "float16"):
            return self.tensor_flops
        return self.fp32_flops

    def to_json(self) -> dict[str, Any]:
        return {
            "format": GPU_SPEC_FORMAT,
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "hbm_bytes_per_s": self.hbm_bytes_per_s,
            "fp32_flops": self.fp32_flops,
            "tensor_flops": self.tensor_flops,
            "pcie_gen": self.pcie_gen,
            "copy_engines": self.copy_engines,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> GpuSpec:
        if obj.get("format") != GPU_SPEC_FORMAT:
            raise PipeswapError(f"expected format {GPU_SPEC_FORMAT!r}, found {obj.get('format')!r}")
        return cls(
            name=str(obj["name"]),
            memory_bytes=int(obj["memory_bytes"]),
            hbm_bytes_per_s=float(obj["hbm_bytes_per_s"]),
            fp32_flops=float(obj["fp32_flops"]),
            tensor_flops=float(obj["tensor_flops"]),
            pcie_gen=int(obj["pcie_gen"]),
            copy_engines=int(obj.get("copy_engines", 2)),
        )


# Figures from /work/shared/reference/hardware.md, "GPU datasheet leads" (NVIDIA datasheets,
# dense figures, no sparsity). Data-centre parts expose several copy engines (CUDA
# deviceQuery asyncEngineCount >= 2), so both copy directions overlap.
_SPECS: tuple[GpuSpec, ...] = (
    # Tesla V100 PCIe 32 GB datasheet: 900 GB/s HBM2, 14 TFLOP/s FP32, 112 TFLOP/s tensor.
    # No TF32 on Volta: float32 matmuls run at the FP32 peak.
    GpuSpec("v100-32gb", 32 * _GiB, 900e9, 14e12, 112e12, pcie_gen=3),
    # GeForce RTX 2080 Ti (Turing TU102): 11 GB GDDR6 at 616 GB/s, 13.4 TFLOP/s FP32, about
    # 54 TFLOP/s FP16 tensor with FP32 accumulate (GeForce runs that at half rate).
    # hardware.md warns that *some* GeForce cards have one copy engine; the RTX 2080 Ti is
    # not one of them: CUDA's deviceQuery reports asyncEngineCount = 3 on it (Stack Overflow,
    # "third copy engine on Turing GPUs", RTX 2080 Ti and 2080 SUPER), so H2D and D2H overlap.
    # Pass copy_engines=1 to a topology preset to model a single-engine card.
    GpuSpec("rtx2080ti", 11 * _GiB, 616e9, 13.4e12, 54e12, pcie_gen=3, copy_engines=2),
    # GeForce RTX 3090: 24 GB GDDR6X at 936 GB/s, 35.6 TFLOP/s FP32, about 71 TFLOP/s tensor.
    GpuSpec("rtx3090", 24 * _GiB, 936e9, 35.6e12, 71e12, pcie_gen=4, copy_engines=2),
    # A100 80GB PCIe datasheet: 1.9 TB/s HBM2e (1,935 GB/s), 19.5 TFLOP/s FP32, 312 TFLOP/s
    # BF16/FP16 tensor.
    GpuSpec("a100-80gb", 80 * _GiB, 1.9e12, 19.5e12, 312e12, pcie_gen=4),
    # H100 PCIe datasheet: 2.0 TB/s HBM2e, 51 TFLOP/s FP32, 756 TFLOP/s BF16 tensor (dense).
    GpuSpec("h100-pcie", 80 * _GiB, 2.0e12, 51e12, 756e12, pcie_gen=5),
    # H200 datasheet: 141 GB HBM3e at 4.8 TB/s, 67 TFLOP/s FP32, 989 TFLOP/s BF16 (dense).
    # Measured on one H200 (hardware.md): bf16 8192^3 matmul ~790 TFLOP/s, copy ~4.3 TB/s.
    GpuSpec("h200", 141 * _GiB, 4.8e12, 67e12, 989e12, pcie_gen=5),
)

_BY_NAME = {spec.name: spec for spec in _SPECS}


def gpu_names() -> list[str]:
    """Names accepted by :func:`gpu_spec`, in table order."""
    return [spec.name for spec in _SPECS]


def gpu_spec(name: str) -> GpuSpec:
    """The spec called ``name`` (case-insensitive); unknown names list the known ones."""
    spec = _BY_NAME.get(name.strip().lower())
    if spec is None:
        raise PipeswapError(f"unknown GPU spec {name!r}; choose one of: {', '.join(gpu_names())}")
    return spec
