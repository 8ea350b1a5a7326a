"""pipeswap/swap/runtime/selective.py: what a layer keeps and recomputes selectively, in
closed form, and a selective re-run that computes the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswap.swap.runtime import recompute
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation
from pipeswap.swap.runtime.selective import OpCall, choose, mode_seconds_per_op
from pipeswap.swap.runtime.transfer import DeviceLedger

B, D, H = 8, 16, 64  # rows, width, hidden width (float32: 4 bytes an element)


class _Block(nn.Module):
    """A transformer MLP block: RMS norm, gated SiLU, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, H)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return x + self.down(F.silu(self.gate(n)) * self.up(n))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block())


def test_a_block_keeps_its_matmuls_outputs_and_recomputes_the_rest() -> None:
    model = _model()
    x = torch.randn(B, D, requires_grad=True)
    layers = dict(model.named_children())
    sizes = measure_recomputation(model, layers, list(layers), lambda: model(x).sum())
    choice = sizes.choices["1"]
    # Kept: the gate's, the up and the down projection's outputs (the down projection saves
    # its input as it runs, so the re-run would run it again: no matmul runs twice).
    assert choice.cached_bytes == 2 * B * H * 4 + B * D * 4
    # Re-run: the norm's rsqrt (B x 1), x * rsqrt and the normed input (B x D each), the
    # SiLU's output and the gated product (B x H each).
    assert choice.rerun_bytes == B * 4 * (1 + 2 * D + 2 * H)
    # Its share of the forward: the re-run's operations, and on a CPU selective
    # checkpointing's dispatch per operation (on these tiny tensors, most of it).
    assert choice.rerun_fraction > 0.0
    # Whole-block recomputation saves all of that again, and the two saved projections too.
    assert sizes.rerun["1"] == choice.rerun_bytes + 2 * B * H * 4


def test_the_dispatch_cost_is_measured_once_on_the_first_layer_chosen_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model()
    x = torch.randn(B, D, requires_grad=True)
    layers = dict(model.named_children())
    measured: list[int] = []

    def per_op(forward: object, ops: int) -> float:
        measured.append(ops)
        return 1e-3  # a millisecond an operation: far more than these tiny operations take

    monkeypatch.setattr(recompute, "mode_seconds_per_op", per_op)
    sizes = measure_recomputation(model, layers, list(layers), lambda: model(x).sum())
    assert len(measured) == 1 and measured[0] > 0  # the first layer's operations, once
    # With a millisecond an operation the re-run costs more than the forward's own time.
    assert all(choice.rerun_fraction > 1.0 for choice in sizes.choices.values())


def test_the_dispatch_cost_on_a_layer_is_a_few_microseconds_an_operation() -> None:
    block, x = _Block(), torch.randn(B, D)
    assert 0.0 <= mode_seconds_per_op(lambda: block(x), 12) < 1e-3


def _call(name: tuple[str, int], outputs: dict[int, int], inputs: set[int], dear: bool) -> OpCall:
    return OpCall(name, outputs, frozenset(inputs), 1.0, dear, False)


def test_every_matmul_up_to_the_re_run_s_end_is_kept_and_nothing_after_it_runs() -> None:
    # mm -> relu (saved) -> mm (saves the relu's output as it runs) -> add (saves nothing).
    calls = [
        _call(("mm", 0), {1: 1000}, {0}, dear=True),
        _call(("relu", 0), {2: 500}, {1}, dear=False),
        _call(("mm", 1), {3: 800}, {2}, dear=True),
        _call(("add", 0), {4: 300}, {3}, dear=False),
    ]
    choice = choose(calls, saved={2: 500}, inputs={0})
    # Both matmuls kept (the second runs before the re-run stops), the relu re-run, the
    # add never: the re-run spends one of the four operations' seconds.
    assert choice.cached == frozenset({("mm", 0), ("mm", 1)})
    assert (choice.cached_bytes, choice.rerun_bytes) == (1800, 500)
    assert choice.rerun_fraction == 1 / 4
    # Selective checkpointing's dispatch, per operation in the forward (4) and the re-run (3).
    slow = choose(calls, saved={2: 500}, inputs={0}, dispatch_s=0.5)
    assert slow.rerun_fraction == (1 + 0.5 * (4 + 3)) / 4


def test_a_selective_rerun_computes_the_same_bits_and_counts_what_it_keeps() -> None:
    model = _model()
    x = torch.randn(B, D, requires_grad=True)
    (model(x).square().sum()).backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    layers = dict(model.named_children())
    ledger = DeviceLedger()
    recomputation = Recomputation(layers, ["0", "1"], ledger, account=True, selective=["1"])
    recomputation.install()
    try:
        recomputation.capture(model, lambda: model(x).sum(), ["0", "1"])
        cached = recomputation.choices["1"].cached_bytes
        recomputation.start_step()
        recomputation.active = True
        out = model(x)
        assert ledger.live_bytes == cached  # the kept outputs, held until the backward
        out.square().sum().backward()
        recomputation.active = False
        recomputation.finish_step()
    finally:
        recomputation.remove()
    got = [x.grad] + [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert ledger.live_bytes == 0
    # The selective layer holds its input and its kept outputs; its re-run saves the rest.
    assert recomputation.kept_bytes["1"] == B * D * 4 + cached
    assert recomputation.rerun_bytes["1"] == recomputation.choices["1"].rerun_bytes


def test_an_hf_llama_recomputed_selectively_in_bf16_computes_the_same_bits() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 32))

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    expected = step()
    names = ["model.layers.0", "model.layers.1"]
    layers = {name: model.get_submodule(name) for name in names}
    recomputation = Recomputation(layers, names, DeviceLedger(), account=False, selective=names)
    recomputation.install()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            recomputation.capture(
                model, lambda: model(input_ids=ids, labels=ids, use_cache=False).loss, names
            )
        assert all(recomputation.choices[name].cached for name in names)
        recomputation.start_step()
        recomputation.active = True
        got = step()
        recomputation.active = False
        assert recomputation.finish_step()[0] == 2  # both layers ran again
    finally:
        recomputation.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_noting_a_forward_s_operations_holds_no_more_than_a_forward_without_gradients() -> None:
    """The naming pass before a planned step must keep the budget: the operations' outputs
    are told apart by their storages' lifetimes, not held to the layer's end (1.16x the
    budget at an HF Llama's first planned step before)."""
    from pipeswap.profiling.meter import DeviceMeter

    model = nn.Sequential(*(_Block() for _ in range(4)))
    x = torch.randn(4096, D, requires_grad=True)
    layers = dict(model.named_children())
    with DeviceMeter("cpu", holding=(model, x)) as meter:
        with torch.no_grad():
            model(x).sum()
        plain = meter.peak
        meter.reset_peak()
        sizes = measure_recomputation(model, layers, list(layers), lambda: model(x).sum())
        noting = meter.peak
    assert noting <= plain * 1.05, (noting, plain)
    assert sizes.choices["1"].cached_bytes == 2 * 4096 * H * 4 + 4096 * D * 4
