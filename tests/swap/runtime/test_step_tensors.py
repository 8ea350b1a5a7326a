"""pipeswap/swap/runtime/step_tensors.py: each pack call named as prepare named it."""

from __future__ import annotations

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.swap.plan import SwapDecision
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.step_tensors import StepTensors
from pipeswap.swap.runtime.transfer import DeviceLedger, HeldTensor, SwapTransfer


def _same(packed: object, tensor: torch.Tensor) -> bool:
    """Kept as it is: the same storage and view, detached (no cycle through its grad_fn)."""
    return (
        isinstance(packed, torch.Tensor)
        and packed.data_ptr() == tensor.data_ptr()
        and packed.shape == tensor.shape
        and packed.grad_fn is None
    )


def _tensors() -> StepTensors:
    ledger = DeviceLedger()
    transfer = SwapTransfer(HostPool([], pin=False), torch.device("cpu"), ledger)
    tensors = StepTensors({}, transfer, ledger)
    tensors.pack_calls = {"l0": [("l0", 0), None]}
    tensors.sizes = {("l0", 0): 16}
    return tensors


def test_a_layers_tensors_are_held_and_counted_by_name() -> None:
    tensors = _tensors()
    tensors.start_step(["l0"])
    x = torch.ones(4)
    assert _same(tensors.pack(x), x)  # outside any layer: passed through, detached
    tensors.layer = "l0"
    held = tensors.pack(x)
    assert isinstance(held, HeldTensor)
    back = tensors.unpack(held)  # a detached alias of x: its bytes, no grad_fn to cycle through
    assert back.data_ptr() == x.data_ptr() and torch.equal(back, x) and back.grad_fn is None
    assert tensors.ledger.live_bytes == 16
    weight = torch.zeros(2)
    assert _same(tensors.pack(weight), weight)  # a parameter's pack call: never swapped
    with pytest.raises(PipeswapError, match="saved more tensors than in the prepare"):
        tensors.pack(x)


def test_without_strict_what_does_not_fit_stays_and_is_counted() -> None:
    """A step that saves other tensors than prepare saw (a mixture of experts' routing)."""
    ledger = DeviceLedger()
    decisions = {("l0", 0): SwapDecision("l0", 0, 16, "l0", None)}
    transfer = SwapTransfer(HostPool([(("l0", 0), 16)]), torch.device("cpu"), ledger)
    tensors = StepTensors(decisions, transfer, ledger, strict=False)
    tensors.pack_calls = {"l0": [("l0", 0), ("l0", 0)]}
    tensors.sizes = {("l0", 0): 16}
    tensors.start_step(["l0"])
    tensors.layer = "l0"
    too_large = torch.ones(5)
    assert _same(tensors.pack(too_large), too_large)  # 20 bytes under a 16-byte name: kept
    tensors.swap_out(("l0", 0))  # the step never saved that name: the swap is skipped
    assert tensors.unmatched == 2
    # A smaller call the plan covers: 12 bytes go to the front of the 16-byte region.
    tensors.start_step(["l0"])
    tensors.layer = "l0"
    smaller = torch.arange(3.0)
    handle = tensors.pack(smaller)
    tensors.swap_out(("l0", 0))
    assert tensors.swapped == 12 and torch.equal(tensors.unpack(handle), torch.arange(3.0))
    first, other = torch.ones(4), torch.full((4,), 2.0)
    tensors.start_step(["l0"])
    tensors.layer = "l0"
    handle = tensors.pack(first)
    assert _same(tensors.pack(other), other)  # the same name, another storage: kept
    tensors.swap_out(("l0", 0))
    assert torch.equal(tensors.unpack(handle), first) and tensors.swapped == 16
    assert tensors.pack(torch.ones(4)) is not None and tensors.unmatched == 4
