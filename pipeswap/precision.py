"""Mixed precision by name (Lightning's): the autocast around a forward, the loss scaler of fp16."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from pipeswap.config_fields import require

__all__ = [
    "DEFAULT_PRECISION",
    "PRECISIONS",
    "LossScaler",
    "autocast",
    "autocast_dtype",
    "check_precision",
    "drop_cached_casts",
]

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
DEFAULT_PRECISION = PRECISIONS[0]

_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def check_precision(precision: str) -> None:
    """Refuse a name that is not one of :data:`PRECISIONS`."""
    require(
        precision in PRECISIONS,
        f"unknown {{precision}} {precision!r}; use one of {', '.join(PRECISIONS)}",
    )


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs matrix products in under ``precision``; None for fp32."""
    check_precision(precision)
    return _AUTOCAST_DTYPES.get(precision)


@contextlib.contextmanager
def autocast(precision: str, device: torch.device | str) -> Iterator[None]:
    """``torch.autocast`` on ``device``'s type in ``precision``'s dtype; nothing for fp32.

    Weights stay float32 (the optimizer updates them in full precision); autocast casts
    them for each operation it lists, and the saved tensors are what those casts made
    (half the bytes of float32 for a matrix product's inputs).
    """
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(torch.device(device).type, dtype=dtype):
        yield


def drop_cached_casts() -> None:
    """A layer's edge in a step that swaps or recomputes: autocast's cached weight casts
    are let go of.

    Autocast caches each weight's cast until the outermost autocast region ends, whoever
    else holds it: a cast that a plan moves to the host at its layer's end, or that a
    recomputed layer does not save, would stay on the device all the same. Dropped at
    each layer's edge, a cast lives as long as its layer's forward or autograd keeps it.
    The cache stays as the user set it, so within a layer a weight used twice is cast once,
    as in the user's own loop: two casts would sum its two gradients in float32 where the
    one cast sums them in the low precision first, and the weights would differ in their
    last bits (ProphetNet). A weight used in two layers' forwards, or by a layer called
    twice a forward (Dory, HRM), is cast at each.
    """
    torch.clear_autocast_cache()


class LossScaler:
    """fp16-mixed's dynamic loss scale (``torch.amp.GradScaler``); pass-through otherwise.

    fp16 gradients underflow without a scale: the loss is multiplied before the backward,
    the gradients are divided back before clipping and the step, and a step whose
    gradients overflowed is skipped while the scale halves (GradScaler's rules).
    """

    def __init__(self, precision: str, device: torch.device) -> None:
        self.scaler = (
            torch.amp.GradScaler(device.type)
            if autocast_dtype(precision) == torch.float16
            else None
        )

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients back (before clipping reads them)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step, skipped when a gradient is not finite; updates the scale."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
