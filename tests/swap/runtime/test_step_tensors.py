"""pipeswap/swap/runtime/step_tensors.py: each pack call named as prepare named it."""

from __future__ import annotations

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.step_tensors import StepTensors
from pipeswap.swap.runtime.transfer import DeviceLedger, HeldTensor, SwapTransfer


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
    assert tensors.pack(x) is x  # outside any layer: passed through
    tensors.layer = "l0"
    held = tensors.pack(x)
    assert isinstance(held, HeldTensor) and tensors.unpack(held) is x
    assert tensors.ledger.live_bytes == 16
    weight = torch.zeros(2)
    assert tensors.pack(weight) is weight  # a parameter's pack call: never swapped
    with pytest.raises(PipeswapError, match="saved more tensors than in the prepare"):
        tensors.pack(x)
