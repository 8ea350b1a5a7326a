"""UnitSwapper: many in-flight forwards of one module, their swapped tensors sent to host
memory and brought back, the same gradients as without it, and the bytes it counts.

Covers: pipeswap/swap/runtime/unit_swapper.py (and StepTensors' lanes in
pipeswap/swap/runtime/step_tensors.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fake_cuda import FakeCuda
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.swap.runtime.unit_swapper import UnitSwapper

LAYERS = ["0", "1", "2", "3", "4", "5"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(64, 8),
    )


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=generator) for _ in range(4)]


def _loss(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: model(x).square().mean()


def _train(swapper: Callable[[nn.Module], UnitSwapper] | None) -> list[torch.Tensor]:
    """Four forwards in flight, then their backwards in order, each under its own seed."""
    model = _model()
    keeper = swapper(model) if swapper is not None else None
    losses = []
    for unit, x in enumerate(_inputs()):
        torch.manual_seed(100 + unit)  # dropout draws per unit
        if keeper is None:
            losses.append(_loss(model, x)())
            continue
        with keeper.forward(unit, _loss(model, x)):
            losses.append(_loss(model, x)())
    for unit, loss in enumerate(losses):
        if keeper is not None:
            keeper.prefetch(unit)
        loss.backward()
        if keeper is not None:
            keeper.after_backward(unit)
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


@pytest.mark.parametrize(
    "swapped,recomputed",
    [(["0", "2"], []), ([], ["3", "4"]), (["0", "2", "5"], ["3", "4"]), (LAYERS, [])],
)
def test_units_that_swap_and_recompute_get_the_same_gradients_bit_for_bit(
    swapped: list[str], recomputed: list[str]
) -> None:
    plain = _train(None)
    swapping = _train(
        lambda m: UnitSwapper(m, LAYERS, swapped=swapped, recomputed=recomputed, capacity=4)
    )
    assert all(torch.equal(a, b) for a, b in zip(plain, swapping, strict=True))


def test_a_unit_holds_its_kept_bytes_until_prefetched_then_all_until_its_backward() -> None:
    model = _model()
    kept_all = UnitSwapper(model, LAYERS, capacity=2)
    x = _inputs()[0]
    with kept_all.forward(0, _loss(model, x)):
        loss = _loss(model, x)()
    whole = kept_all.live_bytes  # one unit, nothing swapped
    loss.backward()
    kept_all.after_backward(0)
    kept_all.close()
    assert whole > 0 and kept_all.live_bytes == 0

    swapper = UnitSwapper(model, LAYERS, swapped=["2", "5"], capacity=2, prefetch_at={7: [0]})
    losses = []
    for unit, x in enumerate(_inputs()[:2]):
        with swapper.forward(unit, _loss(model, x)):
            losses.append(_loss(model, x)())
    moved = swapper.unit_swap_bytes
    assert 0 < moved < whole
    assert swapper.live_bytes == 2 * (whole - moved)  # both units' swapped bytes left
    assert swapper.swapped_bytes == 2 * moved
    swapper.after_action(6)  # no prefetch planned after action 6
    assert swapper.live_bytes == 2 * (whole - moved)
    swapper.after_action(7)  # unit 0's prefetch
    assert swapper.live_bytes == 2 * whole - moved
    losses[0].backward()
    swapper.after_backward(0)
    assert swapper.live_bytes == whole - moved
    losses[1].backward()  # never prefetched: fetched as the backward reads it (late)
    swapper.after_backward(1)
    assert swapper.live_bytes == 0 and swapper.late_fetches > 0
    assert swapper.peak_saved_bytes == 2 * whole - moved
    stats = swapper.stats()
    assert stats["swapped_layers"] == ["2", "5"] and stats["capacity"] == 2


def test_slots_are_reused_and_capacity_is_enforced() -> None:
    model = _model()
    swapper = UnitSwapper(model, LAYERS, swapped=["2"], capacity=1)
    x = _inputs()[0]
    for unit in range(3):  # one lane, used by one unit after another
        with swapper.forward(unit, _loss(model, x)):
            loss = _loss(model, x)()
        loss.backward()
        swapper.after_backward(unit)
    with swapper.forward(3):
        held = _loss(model, x)()
    with pytest.raises(PipeswapError, match="1 units are in flight already"):
        with swapper.forward(4):
            pass
    with pytest.raises(PipeswapError, match="unit 3 is in flight already"):
        with swapper.forward(3):
            pass
    held.backward()


def test_bad_plans_are_refused_naming_the_fix() -> None:
    model = _model()
    with pytest.raises(PipeswapError, match="has no layer 'nine'"):
        UnitSwapper(model, LAYERS, swapped=["nine"], capacity=1)
    with pytest.raises(PipeswapError, match="both swapped and recomputed"):
        UnitSwapper(model, LAYERS, swapped=["2"], recomputed=["2"], capacity=1)
    with pytest.raises(PipeswapError, match="capacity is 0"):
        UnitSwapper(model, LAYERS, capacity=0)
    swapper = UnitSwapper(model, LAYERS, capacity=1)
    with pytest.raises(PipeswapError, match="needs forward_loss"):
        with swapper.forward(0):
            pass
    swapper.close()
    assert not any(m._forward_pre_hooks for m in model)  # close removed every hook


def test_on_cuda_copies_run_beside_compute_and_are_waited_for_one_action_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA path with recording streams and events (fake_cuda): a unit's swap-outs run
    on the side stream during its forward's action and the next one, then the stage waits
    for them; prefetches run on the other side stream; the gradients keep their bits."""
    cuda = FakeCuda()  # no copy finishes until something waits for it
    cuda.install(monkeypatch)
    model = _model()
    swapper = UnitSwapper(model, LAYERS, swapped=["2", "5"], capacity=2, prefetch_at={9: [0, 1]})
    losses = []

    def forward(unit: int) -> None:
        torch.manual_seed(100 + unit)
        x = _inputs()[unit]
        with swapper.forward(unit, _loss(model, x)):
            losses.append(_loss(model, x)())
        swapper.after_action(unit)

    def synchronized() -> int:
        return sum(1 for item in cuda.log if item[0] == "synchronize")

    forward(0)  # the forward's own action: its copies may still run
    whole, moved = swapper.live_bytes, swapper.unit_swap_bytes
    assert synchronized() == 0 and moved > 0
    forward(1)  # unit 0's next action is over: the stage waits for unit 0's copies
    assert synchronized() > 0
    assert swapper.live_bytes == (whole - moved) + whole
    swapper.after_action(2)  # and after one more action, for unit 1's
    assert swapper.live_bytes == 2 * (whole - moved)
    swapper.after_action(9)  # both prefetches issued on the copy-in stream
    out, into = cuda.sides
    copies_out = [item for item in cuda.log if item[:3] == ("copy", out, "d2h")]
    copies_in = [item for item in cuda.log if item[:3] == ("copy", into, "h2d")]
    assert len(copies_in) == len(copies_out) > 0  # every swapped storage came back early
    for unit, loss in enumerate(losses):
        loss.backward()
        swapper.after_backward(unit)
    grads = [p.grad for p in model.parameters()]
    assert swapper.late_fetches == 0 and swapper.live_bytes == 0
    two = _train_units(2)
    assert all(torch.equal(a, b) for a, b in zip(two, grads, strict=True))


def _train_units(units: int) -> list[torch.Tensor]:
    model = _model()
    losses = []
    for unit, x in enumerate(_inputs()[:units]):
        torch.manual_seed(100 + unit)
        losses.append(_loss(model, x)())
    for loss in losses:
        loss.backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


def test_storages_the_caller_keeps_anyway_are_not_copied() -> None:
    """A stage holds its input leaves and outputs until the backward: a planned swap of
    one of those storages would free nothing, so it is skipped and counted as kept."""
    model = _model()
    swapper = UnitSwapper(model, LAYERS, swapped=["0", "2"], capacity=1)
    x = _inputs()[0]
    with swapper.forward(0, _loss(model, x)):
        loss = _loss(model, x)()
    sent, held = swapper.unit_swap_bytes, swapper.live_bytes
    loss.backward()
    swapper.after_backward(0)
    with swapper.forward(1):
        loss = _loss(model, x)()
        swapper.keep([x])  # layer 0 saves the input itself, which the caller holds
    assert swapper.kept_bytes == x.untyped_storage().nbytes()
    assert swapper.unit_swap_bytes == sent - swapper.kept_bytes
    assert swapper.live_bytes == held + swapper.kept_bytes
    loss.backward()
    swapper.after_backward(1)
    assert swapper.live_bytes == 0
