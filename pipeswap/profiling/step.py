"""One training step run block by block, so each block's forward and backward stand alone."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.models.adapt import adapt
from pipeswap.models.base import LayeredModel
from pipeswap.optim import STATE_BUFFERS
from pipeswap.profiling.profile import LayerProfile, Profile

__all__ = [
    "Around",
    "Boundary",
    "StepShapes",
    "dtype_name",
    "ensure_layered",
    "example_batch",
    "is_allocation_error",
    "optimizer_state_bytes",
    "param_bytes_by_layer",
    "parse_dtype",
    "run_step",
    "step_profile",
]

# around(layer_name, phase) wraps each block's pass; phase is "forward" or "backward".
Around = Callable[[str, str], AbstractContextManager[object]]

# What passes between blocks: a tensor or a tuple of tensors, as in a pipeline stage.
Boundary = torch.Tensor | tuple[torch.Tensor, ...]


def ensure_layered(model: object, caller: str) -> LayeredModel:
    """The LayeredModel to profile for ``model``, any ``nn.Module``, by
    pipeswap.models.adapt.adapt (a LayeredModel is used as it is; other modules, a Hugging
    Face model included, are cut at their blocks into layers sharing the model's own
    modules); anything else is refused naming ``caller``.
    """
    if not isinstance(model, torch.nn.Module):
        raise PipeswapError(
            f"{caller}() needs an nn.Module or a model name, not a {type(model).__name__}"
        )
    return adapt(model)


@dataclass(frozen=True)
class StepShapes:
    """What a step reports besides the hooks' measurements."""

    output_bytes: dict[str, int]
    loss: float | None


def _no_hook(name: str, phase: str) -> AbstractContextManager[object]:
    return nullcontext()


class _BlockInput(torch.autograd.Function):
    """Identity whose output is a non-leaf sharing its input's storage.

    A block's input in a real step is the previous block's output, a non-leaf; some
    code treats leaves differently (autocast caches its casts of leaves that need a
    gradient, so three Linears reading one leaf save one cast, not three), so the
    profiler must not hand a block a bare leaf.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # same storage, not a view: in-place ops behave as in training

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _tensors(value: Boundary) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _checked(value: object, name: str, model: LayeredModel) -> Boundary:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
        return value
    raise PipeswapError(
        f"block {name!r} of {model.name} returns {type(value).__name__}, but blocks pass a "
        "tensor or a tuple of tensors to the next block: make it return one of those"
    )


def _cut(value: Boundary) -> tuple[Boundary, tuple[torch.Tensor | None, ...]]:
    """The next block's input, cut from the graph before it, and the leaves that will
    hold its gradients (None for members that carry none: integers, constants)."""
    leaves = tuple(
        t.detach().requires_grad_() if t.requires_grad else None for t in _tensors(value)
    )
    fed = tuple(
        t if leaf is None else _BlockInput.apply(leaf) for t, leaf in zip(_tensors(value), leaves)
    )
    return (fed if isinstance(value, tuple) else fed[0]), leaves


def run_step(
    model: LayeredModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    around: Around = _no_hook,
    *,
    backward: bool = True,
) -> StepShapes:
    """Forward every block, the loss, then (``backward``) backward block by block in reverse.

    A block passes a tensor or a tuple of tensors to the next, as pipeline stages do. Each
    member that needs a gradient reaches the next block through a fresh leaf sharing its
    storage (then a no-op autograd node, so the block sees a non-leaf as in a real step);
    integer members and others without a gradient pass as they are. A block's backward is
    a separate ``torch.autograd.backward(outputs, grads)`` whose input gradients feed the
    block before. That computes exactly the gradients of one whole-model backward, with a
    clean boundary per block to time or count. The loss belongs to the last block.
    """
    blocks = list(model.named_children())
    leaves: list[tuple[torch.Tensor | None, ...]] = []
    outputs: list[Boundary | None] = []
    output_bytes: dict[str, int] = {}
    loss: torch.Tensor | None = None
    x: Boundary = inputs
    for position, (name, block) in enumerate(blocks):
        last = position == len(blocks) - 1
        fed, held = (x, (None,)) if position == 0 else _cut(x)
        with around(name, "forward"):
            out = _checked(block(fed), name, model)
            if last:
                loss = model.loss(out, targets)  # type: ignore[arg-type]
        leaves.append(held)
        output_bytes[name] = sum(t.numel() * t.element_size() for t in _tensors(out))
        # The last block's backward starts from the loss: its output (a language model's
        # logits) is let go of once the loss is made, as in a whole-model step.
        outputs.append(None if last else out)
        if not last:
            x = out
        del out
    grads: tuple[torch.Tensor | None, ...] = ()
    for position in reversed(range(len(blocks)) if backward else ()):
        name = blocks[position][0]
        produced = outputs[position]
        with around(name, "backward"):
            if position == len(blocks) - 1:
                assert loss is not None
                loss.backward()
            elif produced is not None:
                pairs = [
                    (o, g)
                    for o, g in zip(_tensors(produced), grads)
                    if g is not None and o.requires_grad
                ]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(None if leaf is None else leaf.grad for leaf in leaves[position])
        # Let this block's activations go, as a whole-model backward would.
        outputs[position] = None
        leaves[position] = ()
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


def example_batch(
    model: LayeredModel,
    batch: int,
    seq_len: int | None,
    image_size: int | None,
    device: torch.device | str,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's example batch to profile, a shape it refuses as a PipeswapError."""
    try:
        return model.example_batch(
            batch, seq_len=seq_len, image_size=image_size, device=device, dtype=dtype
        )
    except ValueError as exc:
        raise PipeswapError(str(exc)) from None


def step_profile(
    model: LayeredModel,
    batch: int,
    seq_len: int | None,
    image_size: int | None,
    optimizer: str,
    layers: list[LayerProfile],
    **fields: Any,
) -> Profile:
    """The Profile of one step of ``model``, measured or estimated (``fields``: source,
    device, dtype, memory, notes, ...): the optimizer state its parameters need, and the
    sequence length or image size only where its task takes one."""
    return Profile(
        model=model.name,
        batch=batch,
        optimizer=optimizer,
        optimizer_state_bytes=optimizer_state_bytes(
            optimizer, sum(layer.param_bytes for layer in layers)
        ),
        layers=tuple(layers),
        seq_len=seq_len if model.task_entry.has_seq_len else None,
        image_size=image_size if model.task_entry.has_image_size else None,
        **fields,
    )


def optimizer_state_bytes(optimizer: str, param_bytes: int) -> int:
    """State an optimizer keeps: momentum SGD one buffer per parameter, Adam(W) two."""
    factor = STATE_BUFFERS.get(optimizer)
    if factor is None:
        raise ConfigError(
            f"unknown {{optimizer}} {optimizer!r}; choose one of: {', '.join(STATE_BUFFERS)}"
        )
    return factor * param_bytes


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or ``"float32"``; also ``bfloat16`` and ``float16``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported {{dtype}} {dtype}; choose one of: {', '.join(_DTYPES)}")
        return dtype
    parsed = _DTYPES.get(dtype.removeprefix("torch."))
    if parsed is None:
        raise ConfigError(f"unknown {{dtype}} {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    return parsed


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_ALLOCATION_MARKERS = ("out of memory", "can't allocate", "cannot allocate", "not enough memory")


def is_allocation_error(exc: BaseException) -> bool:
    """True for an out-of-memory failure from any PyTorch allocator (or Python's own)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(
        marker in str(exc).lower() for marker in _ALLOCATION_MARKERS
    )
