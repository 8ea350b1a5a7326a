"""Meta runs that read a model's costs as the CPU would run it: attention through the
kernel the CPU would choose, meta ops taking what their real kernels take."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from pipeswap.models.meta_ops import meta_like_real

__all__ = ["meta_attention_like_cpu"]


def _sdpa_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _cpu_twin(tensor: torch.Tensor) -> torch.Tensor:
    # Uninitialised CPU memory is never touched: only shapes, strides and dtype matter.
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The float mask SDPA hands its kernels: a boolean mask becomes 0 / -inf in the
    query's dtype (a new tensor, which the CPU flash kernel saves for backward)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.full((), float("-inf"), dtype=dtype, device=mask.device))


class _CpuAttentionOnMeta(TorchFunctionMode):
    """On meta, PyTorch picks the math attention backend (which saves the T x T matrix);
    the CPU picks its flash kernel when it can. Route meta calls to the kernel the CPU
    would choose, so saved tensors and FLOPs match a real CPU run and, within a few bytes,
    a CUDA flash or memory-efficient kernel (q, k, v, output and an O(T) logsumexp).

    Two details of the CPU path matter for bytes: with ``enable_gqa`` the flash kernel
    reads K and V with fewer heads than Q as they are (the math path would repeat them
    and keep the attention matrix), and a boolean mask reaches the kernel, which saves
    it, converted to an additive mask in the query's dtype.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._C._nn.scaled_dot_product_attention:
            q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_arguments(*args, **kwargs)
            if q.device.type == "meta" and dropout_p == 0.0:
                twins = [_cpu_twin(t) for t in (q, k, v)]
                twin_mask = None if mask is None else _cpu_twin(mask)
                # Private and mistyped in torch's stubs: (q, k, v, mask, dropout_p, is_causal).
                choose: Any = torch._fused_sdp_choice
                choice = choose(
                    *twins, twin_mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa
                )
                if choice == SDPBackend.FLASH_ATTENTION.value:
                    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                        q,
                        k,
                        v,
                        dropout_p,
                        is_causal,
                        attn_mask=_additive_mask(mask, q.dtype),
                        scale=scale,
                    )
                    return out
        return func(*args, **kwargs)


@contextmanager
def meta_attention_like_cpu() -> Iterator[None]:
    """Make ``F.scaled_dot_product_attention`` on meta tensors use the CPU's kernel choice,
    and meta ops take what their real kernels take (pipeswap.models.meta_ops): every run
    that reads a model's costs on meta enters this, its backward included."""
    with _CpuAttentionOnMeta(), meta_like_real():
        yield
