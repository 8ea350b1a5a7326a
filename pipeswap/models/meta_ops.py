"""Meta-device runs that take what the real kernels take.

pipeswap runs a user's model on the meta device to learn its shapes, FLOPs and saved
bytes without allocating it (a model's spec, its layers' outputs, a profile estimate).
A few of torch's meta kernels refuse inputs that the real kernels accept, so a
model that trains fails there first. :func:`meta_like_real` answers such a call with the
output the real kernel gives (its shape, dtype and layout); every other call, and every
call the real kernel would refuse too, is left to torch.

``torch.nn.functional.grouped_mm`` is one: its meta kernel copies the checks of the first
CUDA kernel and accepts bfloat16 only, while the CPU kernel takes float32 and float16 as
well (transformers calls it so on CUDA too). Hugging Face's mixture-of-experts models
(Mixtral, Qwen2/3-MoE, OLMoE and others) run their experts with it by default (the
"grouped_mm" experts implementation), in float32 too. The answer repeats the real
kernels' shape rules, not their 16-byte stride checks: a model those refuse fails when it
runs for real, as it does without pipeswap. What trains is never changed: real tensors
run the real kernels as ever.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["meta_like_real"]

# What grouped_mm's real kernels take (torch's meta kernel: bfloat16 alone).
_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The real kernels pad the output's rows to 16 bytes (a CPU float32 [8, 10] has stride 12).
_ROW_ALIGNMENT_BYTES = 16


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """``aten._grouped_mm`` on meta tensors as the real kernel computes it: its output for
    inputs of one dtype it takes, with no bias and no other output dtype (what
    transformers' experts pass); None for anything else (torch's own answer stands)."""
    if not (
        mat_a.is_meta
        and mat_b.is_meta
        and mat_a.dtype == mat_b.dtype
        and mat_a.dtype in _GROUPED_MM_DTYPES
        and bias is None
        and out_dtype in (None, mat_a.dtype)
        and mat_a.dim() in (2, 3)
        and mat_b.dim() in (2, 3)
        and mat_a.size(-1) == mat_b.size(-2)
        and (offs is None) == (mat_a.dim() == mat_b.dim() == 3)
    ):
        return None
    # The shapes of torch's meta kernel: offs splits the one 2-D operand into groups.
    groups = mat_b.size(0) if mat_b.dim() == 3 else mat_a.size(0) if mat_a.dim() == 3 else None
    if offs is not None and groups is not None and offs.size(0) != groups:
        return None
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None  # checked above: only 3-D by 3-D goes without offs
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        if mat_a.size(0) != mat_b.size(0):
            return None
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    alignment = _ROW_ALIGNMENT_BYTES // mat_a.element_size()
    row = -(-size[-1] // alignment) * alignment
    stride = [size[1] * row, row, 1] if len(size) == 3 else [row, 1]
    return torch.empty_strided(size, stride, dtype=mat_a.dtype, device="meta")


# aten ops whose meta kernel is stricter than their real ones, and what those compute.
_FALLBACKS: dict[Any, Callable[..., torch.Tensor | None]] = {
    torch.ops.aten._grouped_mm.default: _grouped_mm,
}


class _MetaLikeReal(TorchDispatchMode):
    """Where torch's meta kernel of an op in ``_FALLBACKS`` refuses a call, the output of
    the real kernel instead (None from the fallback: torch's refusal stands)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        fallback = _FALLBACKS.get(func)
        if fallback is None:
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except RuntimeError:
            found = fallback(*args, **kwargs)
            if found is None:
                raise
            return found


@contextmanager
def meta_like_real() -> Iterator[None]:
    """Run the body with meta kernels that take what the real kernels take (see the module
    docstring); backward passes the body runs are covered too. Real tensors run as ever."""
    with _MetaLikeReal():
        yield
