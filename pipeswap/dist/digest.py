"""params_sha256: one digest of a model's parameters, the same whether it is whole or in stages.

Each parameter gets its own SHA-256 (of its name, dtype, shape and raw bytes); the model's
digest is the SHA-256 of ``name:digest;`` over every ``named_parameters()`` name in sorted
order. A pipeline stage computes the digests of its own parameters only, and rank 0
combines them: the result equals the digest of the whole model on one process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["combine_digests", "parameter_digests", "params_sha256", "tensor_sha256"]


def tensor_sha256(name: str, tensor: torch.Tensor) -> str:
    """SHA-256 of one named tensor: name, dtype, shape, then its bytes (on the CPU)."""
    data = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
    if data.numel():
        digest.update(data.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parameter_digests(module: nn.Module) -> dict[str, str]:
    """Per parameter of ``module``, by its ``named_parameters()`` name: its SHA-256."""
    return {name: tensor_sha256(name, p) for name, p in module.named_parameters()}


def combine_digests(digests: Mapping[str, str]) -> str:
    """The model digest from per-parameter digests (any order in; sorted by name inside)."""
    combined = hashlib.sha256()
    for name in sorted(digests):
        combined.update(f"{name}:{digests[name]};".encode())
    return combined.hexdigest()


def params_sha256(module: nn.Module) -> str:
    """The digest of every parameter of ``module`` (see the module docstring)."""
    return combine_digests(parameter_digests(module))
