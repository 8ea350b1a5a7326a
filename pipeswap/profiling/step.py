"""One training step run block by block, so each block's forward and backward stand alone."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel

# around(layer_name, phase) wraps each block's pass; phase is "forward" or "backward".
Around = Callable[[str, str], AbstractContextManager[object]]

OPTIMIZER_STATE_FACTOR = {"sgd": 1, "adam": 2, "adamw": 2}


@dataclass(frozen=True)
class StepShapes:
    """What a step reports besides the hooks' measurements."""

    output_bytes: dict[str, int]
    loss: float | None


def _no_hook(name: str, phase: str) -> AbstractContextManager[object]:
    return nullcontext()


def run_step(
    model: LayeredModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    around: Around = _no_hook,
) -> StepShapes:
    """Forward every block, the loss, then backward block by block in reverse.

    Each block after the first gets its input as a fresh leaf that shares the previous
    output's storage (``detach().requires_grad_()``); its backward is a separate
    ``torch.autograd.backward(output, grad)`` whose input gradient feeds the block before.
    That computes exactly the gradients of one whole-model backward, with a clean boundary
    per block to time or count. The loss's forward and backward belong to the last block.
    """
    blocks = list(model.named_children())
    leaves: list[torch.Tensor | None] = []
    outputs: list[torch.Tensor | None] = []
    output_bytes: dict[str, int] = {}
    loss: torch.Tensor | None = None
    x = inputs
    for position, (name, block) in enumerate(blocks):
        leaf = x
        if position > 0 and x.is_floating_point():
            leaf = x.detach().requires_grad_()
        with around(name, "forward"):
            out = block(leaf)
            if position == len(blocks) - 1:
                loss = model.loss(out, targets)
        leaves.append(leaf)
        outputs.append(out)
        output_bytes[name] = out.numel() * out.element_size()
        x = out
    grad: torch.Tensor | None = None
    for position in reversed(range(len(blocks))):
        name = blocks[position][0]
        out = outputs[position]
        with around(name, "backward"):
            if position == len(blocks) - 1:
                assert loss is not None
                loss.backward()
            elif out is not None and out.requires_grad and grad is not None:
                torch.autograd.backward(out, grad)
        held = leaves[position]
        grad = held.grad if held is not None and held.requires_grad else None
        # Let this block's activations go, as a whole-model backward would.
        outputs[position] = None
        leaves[position] = None
    value = None if loss is None or loss.device.type == "meta" else float(loss.detach())
    return StepShapes(output_bytes, value)


def param_bytes_by_layer(model: LayeredModel) -> dict[str, int]:
    """Bytes of each block's parameters; a tied parameter counts once, in its first block."""
    seen: set[int] = set()
    result: dict[str, int] = {}
    for name, block in model.named_children():
        total = 0
        for param in block.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            total += param.numel() * param.element_size()
        result[name] = total
    return result


def optimizer_state_bytes(optimizer: str, param_bytes: int) -> int:
    """State an optimizer keeps: momentum SGD one buffer per parameter, Adam(W) two."""
    factor = OPTIMIZER_STATE_FACTOR.get(optimizer)
    if factor is None:
        raise PipeswapError(
            f"unknown optimizer {optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATE_FACTOR)}"
        )
    return factor * param_bytes


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or ``"float32"``; also ``bfloat16`` and ``float16``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise PipeswapError(f"unsupported dtype {dtype}; choose one of: {', '.join(_DTYPES)}")
        return dtype
    parsed = _DTYPES.get(dtype.removeprefix("torch."))
    if parsed is None:
        raise PipeswapError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    return parsed


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
