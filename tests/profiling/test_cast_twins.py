"""CastTwins: a repeated cast of one tensor is saved once, and the backward is the same."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipeswap.profiling.cast_twins import CastTwins
from pipeswap.profiling.saved import storage_key


class _ThreeHeads(nn.Module):
    """A normalised input read by three projections, as an unfused attention reads it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return (self.q(h) * self.k(h) + self.v(h)).float().sum()


def _saved_storages(
    model: nn.Module, x: torch.Tensor, twins: CastTwins | None
) -> tuple[set[int], dict[str, torch.Tensor]]:
    """The storages autograd saved in one step (parameters left out) and the gradients."""
    params = {storage_key(p) for p in model.parameters()}
    seen: set[int] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if twins is not None:
            tensor = twins.share(tensor)
        if storage_key(tensor) not in params:
            seen.add(tensor.untyped_storage().data_ptr())
        return tensor

    model.zero_grad(set_to_none=True)
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False),
    ):
        loss = model(x)
    loss.backward()
    return seen, {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]


def test_three_casts_of_one_input_are_saved_once_and_the_gradients_are_the_same() -> None:
    model, x = _ThreeHeads(), torch.randn(4, 8, 16)
    plain, expected = _saved_storages(model, x, None)
    twins = CastTwins()
    shared, grads = _saved_storages(model, x, twins)
    # Of the three bf16 copies of the norm's output, two are not held: and under
    # autocast without its cache each weight's cast is a saved storage of its own, none shared.
    assert len(plain) - len(shared) == 2
    assert twins.shared_bytes == 2 * 4 * 8 * 16 * 2
    for name, grad in grads.items():
        assert torch.equal(grad, expected[name]), name


def _cast_twice(between: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
    source = torch.randn(4, 4, requires_grad=True) * 1.0
    first = source.to(torch.bfloat16)
    second = between(source).to(torch.bfloat16)
    twins = CastTwins()
    return twins.share(first), twins.share(second), first, second


def test_a_cast_of_the_same_values_is_the_first_one() -> None:
    kept_first, kept_second, first, _ = _cast_twice(lambda s: s)
    assert kept_first is first and kept_second is first


def test_a_cast_after_an_in_place_write_or_of_another_view_is_its_own() -> None:
    _, kept, _, second = _cast_twice(lambda s: s.mul_(2))
    assert kept is second  # the source was written: its cast holds other values
    _, kept, _, second = _cast_twice(lambda s: s.t())
    assert kept is second  # another view of the source: another tensor


def test_casts_to_other_dtypes_and_across_a_reset_are_not_shared() -> None:
    source = torch.randn(4, 4, requires_grad=True) * 1.0
    twins = CastTwins()
    half, bf16 = source.to(torch.float16), source.to(torch.bfloat16)
    assert twins.share(half) is half and twins.share(bf16) is bf16
    twins.reset()
    again = source.to(torch.float16)
    assert twins.share(again) is again  # a layer's edge: matched within one layer only


def test_tensors_that_are_not_casts_pass_through() -> None:
    source = torch.randn(4, 4, requires_grad=True)
    twins = CastTwins()
    product = source * 2
    assert twins.share(source) is source and twins.share(product) is product
    constant = torch.randn(4, 4)  # its casts have no autograd node to be matched by
    first, second = constant.to(torch.bfloat16), constant.to(torch.bfloat16)
    assert twins.share(first) is first and twins.share(second) is second
