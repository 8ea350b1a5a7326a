"""pipeswap/swap/runtime/recompute.py: recomputed layers' forwards wrapped, and given back."""

from __future__ import annotations

import torch
from torch import nn

from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation
from pipeswap.swap.runtime.transfer import DeviceLedger


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2


def test_a_recomputed_layer_reruns_in_the_backward_with_the_same_result() -> None:
    layers = {"a": _Scale(), "b": _Scale()}
    ledger = DeviceLedger()
    recomputation = Recomputation(layers, ["b"], ledger, account=True)
    x = torch.randn(4, requires_grad=True)
    expected = torch.autograd.grad(layers["b"](layers["a"](x)).sum(), x)[0]
    recomputation.install()
    assert "forward" in vars(layers["b"]) and "forward" not in vars(layers["a"])
    recomputation.rerun_bytes = {"b": 16}
    recomputation.start_step()
    recomputation.active = True
    got = torch.autograd.grad(layers["b"](layers["a"](x)).sum(), x)[0]
    recomputation.active = False
    assert torch.equal(got, expected)
    assert recomputation.finish_step() == (1, 16)  # b ran again once, saving 16 bytes
    assert ledger.live_bytes == 0  # its bytes were let go of with the step
    recomputation.remove()
    assert "forward" not in vars(layers["b"])


def test_recomputations_removed_in_any_order_leave_the_others_installed() -> None:
    """Plans of several shapes wrap one model at once; the first made is often the first
    closed (a shape planned again): the later one keeps recomputing, and once every one is
    removed the layer has its own forward back."""
    layers = {"b": _Scale()}
    first, second = (Recomputation(layers, ["b"], DeviceLedger(), account=True) for _ in "12")
    first.install()
    second.install()
    first.remove()
    x = torch.randn(4, requires_grad=True)
    second.rerun_bytes = {"b": 16}
    second.start_step()
    second.active = True
    torch.autograd.grad(layers["b"](x).sum(), x)
    second.active = False
    assert second.finish_step() == (1, 16)  # still wrapped: b ran again in the backward
    second.remove()
    assert "forward" not in vars(layers["b"])
    first.install()
    second.install()
    second.remove()
    first.remove()
    assert "forward" not in vars(layers["b"])


class _Projections(nn.Module):
    """A block given (hidden, context) in one tuple, as pipeswap's blocks of a Hugging Face
    model are: one input cast three times under autocast (a query, a key and a value)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(16, 16) for _ in "qkv")

    def forward(self, packed: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        hidden, context = packed
        x = hidden * context
        return hidden + self.q(x) * self.k(x) + self.v(x), context


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Projections(), _Projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        context = torch.full((16,), 0.5)  # given to every block, made by the model
        return self.b(self.a((x * 2, context)))[0].float().sum()


def test_recomputing_counts_what_the_checkpoint_holds_and_its_rerun_saves() -> None:
    """Measured on a bf16 Llama: torch's checkpoint holds a tuple argument by reference
    (no saved-tensor hook sees it: kept_bytes read 0, 0.5 MB short per layer), and its
    re-run saves every cast of a repeated one (rerun_bytes counted it once)."""
    torch.manual_seed(0)
    model = _Stack().train()
    x = torch.randn(8, 16, requires_grad=True)
    layers = {"a": model.a, "b": model.b}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sizes = measure_recomputation(model, layers, ["a", "b"], lambda: model(x), selective=False)
        # What a's forward saves, every cast apart: the re-run inside the checkpoint.
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        inputs = (x * 2, torch.full((16,), 0.5))  # saved again by the re-run, not copied
        given = {t.untyped_storage()._cdata for t in inputs}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage()._cdata
            if key not in params and key not in given:
                saved[key] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.a(inputs)
    hidden_bytes, context_bytes = 8 * 16 * 4, 16 * 4
    # Each layer as if recomputed alone (a profile's bytes): b's checkpoint holds the
    # context too when a is not recomputed.
    assert sizes.kept == {"a": hidden_bytes + context_bytes, "b": hidden_bytes + context_bytes}
    assert sizes.rerun["a"] == sum(saved.values())
    assert sizes.rerun["a"] > 0 and sizes.rerun["b"] == sizes.rerun["a"]


def test_a_layer_recomputed_alone_keeps_what_its_profile_says_counting_shared_inputs_once() -> None:
    """A half-frozen Llama on padded batches: every block is given the 4D mask and the
    rotary pair by keyword, and the blocks before the last saved the pair too. The profile
    counted what several layers are given for the first only (a frozen block no plan
    recomputes), the runtime counted the pair twice (saved by the block before, and held by
    the checkpoint): the smallest budget named was refused by the run that took it."""
    torch.manual_seed(0)
    model = _Stack().train()
    x = torch.randn(8, 16, requires_grad=True)
    layers = {"a": model.a, "b": model.b}
    names = ["a", "b"]
    profiled = measure_recomputation(model, layers, names, lambda: model(x), selective=False)
    run = Recomputation(layers, ["b"], DeviceLedger(), account=False)
    run.install()
    try:
        run.capture(model, lambda: model(x), names)
    finally:
        run.remove()
    hidden_bytes, context_bytes = 8 * 16 * 4, 16 * 4
    assert run.kept_bytes == {"b": hidden_bytes + context_bytes}  # the context once
    assert profiled.kept["b"] == run.kept_bytes["b"]


def test_a_recomputed_spectral_norm_layer_trains_as_without_recomputation() -> None:
    """spectral_norm runs a step of power iteration in each training forward, on buffers its
    weight is normalised by: the re-run must start from them as the forward found them."""
    from torch.nn.utils.parametrizations import spectral_norm

    def trained(recompute: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = {n: spectral_norm(nn.Linear(6, 6)) for n in ("a", "b")}
        model = nn.Sequential(*layers.values())
        recomputation = Recomputation(layers, ["a", "b"], DeviceLedger(), account=False)
        if recompute:
            recomputation.install()
            recomputation.start_step()
            recomputation.active = True
        x = torch.randn(5, 6)
        model(x).square().sum().backward()
        return [t.detach().clone() for t in (*model.parameters(), *model.buffers())] + [
            p.grad for p in model.parameters() if p.grad is not None
        ]

    plain, recomputed = trained(False), trained(True)
    assert len(plain) == len(recomputed) > 8
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))
