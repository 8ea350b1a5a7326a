"""Profiling models as users bring them: left untouched, tuple outputs, autocast, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel
from pipeswap.profiling.estimate import estimate, meta_copy
from pipeswap.profiling.measure import measure
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.step import run_step
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.swap.runtime.executor import SwapExecutor
from tests.models.tiny_lm import TinyLM

# ---- 1. measure() leaves the model as it found it ---------------------------------------


def _stateful() -> LayeredModel:
    """BatchNorm (buffers), dropout (the RNG), a frozen layer and a submodule in eval mode."""
    torch.manual_seed(0)
    blocks = [
        ("conv", nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())),
        ("drop", nn.Sequential(nn.Flatten(), nn.Dropout(0.5), nn.Linear(64, 16))),
        ("frozen", nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))),
        ("head", nn.Linear(16, 5)),
    ]
    model = LayeredModel("stateful", blocks, "classify", num_classes=5, in_channels=3)
    model.frozen[0].weight.requires_grad_(False)
    model.frozen[1].eval()  # a mode the user chose for one submodule
    # Gradients left over from the user's own step.
    images, labels = model.example_batch(2, image_size=4, seed=7)
    model.loss(model(images), labels).backward()
    return model


def _state(model: nn.Module) -> dict[str, Any]:
    """Everything a profiler run could change, as plain comparable values."""
    return {
        "objects": [id(p) for p in model.parameters()] + [id(b) for b in model.buffers()],
        "tensors": {
            name: (t.dtype, t.device, t.detach().clone())
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        },
        "grads": {
            name: None if p.grad is None else (id(p.grad), p.grad.clone())
            for name, p in model.named_parameters()
        },
        "training": {name: m.training for name, m in model.named_modules()},
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
    }


def _assert_same_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["objects"] == after["objects"]
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, (dtype, device, values) in before["tensors"].items():
        dtype_after, device_after, values_after = after["tensors"][name]
        assert (dtype, device) == (dtype_after, device_after), name
        assert torch.equal(values, values_after), name  # same dtype, no NaN: bitwise
    for name, grad in before["grads"].items():
        other = after["grads"][name]
        assert (grad is None) == (other is None), name
        if grad is not None:
            assert grad[0] == other[0] and torch.equal(grad[1], other[1]), name  # same object
    assert before["training"] == after["training"]
    assert before["requires_grad"] == after["requires_grad"]
    assert torch.equal(before["rng"], after["rng"])
    if before["cuda_rng"] is not None and after["cuda_rng"] is not None:
        assert all(torch.equal(a, b) for a, b in zip(before["cuda_rng"], after["cuda_rng"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_leaves_the_model_and_the_rng_as_it_found_them(dtype: str) -> None:
    model = _stateful()
    before = _state(model)
    measure(model, 4, image_size=4, dtype=dtype, warmup=1, repeats=2)
    _assert_same_state(before, _state(model))


def test_estimate_leaves_a_meta_model_as_it_found_it() -> None:
    model = meta_copy(_stateful())
    model.frozen[1].eval()
    before = {name: m.training for name, m in model.named_modules()}
    rng = torch.get_rng_state()
    estimate(model, 4, image_size=4)
    assert {name: m.training for name, m in model.named_modules()} == before
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_profile_does_not_depend_on_the_mode_the_model_arrived_in() -> None:
    trained = measure(_stateful(), 4, image_size=4, warmup=0, repeats=1)
    model = _stateful()
    model.eval()
    evaluated = measure(model, 4, image_size=4, warmup=0, repeats=1)
    assert [la.saved for la in evaluated.layers] == [la.saved for la in trained.layers]
    assert evaluated.notes["loss"] == trained.notes["loss"]
    assert not any(m.training for m in model.modules())  # and it is still in eval mode


def test_a_model_in_another_dtype_is_measured_in_the_asked_dtype_and_left_alone() -> None:
    model = _stateful().to(torch.bfloat16)
    before = _state(model)
    profile = measure(model, 4, image_size=4, dtype="float32", warmup=0, repeats=1)
    _assert_same_state(before, _state(model))
    as_bf16 = measure(model, 4, image_size=4, dtype="bfloat16", warmup=0, repeats=1)
    assert profile.param_bytes == 2 * as_bf16.param_bytes


class _WritesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.fc.weight.mul_(0.5)  # a parameter update hidden in forward
        return self.fc(x)


def test_a_forward_that_writes_its_parameters_is_reported_not_hidden() -> None:
    blocks = [("flat", nn.Flatten()), ("w", _WritesItsWeight()), ("head", nn.Linear(4, 2))]
    model = LayeredModel("writer", blocks, "classify", num_classes=2, in_channels=4)
    with pytest.raises(PipeswapError, match=r"wrote parameters in place \(w\.fc\.weight\)"):
        measure(model, 2, image_size=1, warmup=0, repeats=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measuring_a_cpu_model_on_cuda_leaves_it_on_the_cpu() -> None:
    model = _stateful()
    torch.cuda.init()
    before = _state(model)
    profile = measure(model, 4, image_size=4, device="cuda", warmup=0, repeats=1)
    assert profile.device == "cuda"
    _assert_same_state(before, _state(model))
    assert all(p.device.type == "cpu" for p in model.parameters())


# ---- 2. blocks that return a tuple of tensors -------------------------------------------


class _Tokens(nn.Module):
    """Embeds token ids and passes the ids and a padding mask on, as a tuple."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.embed(ids), ids, ids != 0


class _Mixer(nn.Module):
    """Reads a (hidden, ids, mask) tuple, returns a new one; records what needs a gradient."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.seen: list[list[bool]] = []

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, ids, mask = inputs
        self.seen.append([t.requires_grad for t in inputs])
        out = torch.tanh(self.fc(hidden)) * mask.unsqueeze(-1)
        return hidden + out, ids, mask


class _Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, vocab)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        hidden, _, mask = inputs
        return self.fc(hidden * mask.unsqueeze(-1))


def _tuple_model(device: str = "cpu") -> LayeredModel:
    torch.manual_seed(0)
    with torch.device(device):
        blocks = [
            ("tokens", _Tokens(32, 8)),
            ("mix0", _Mixer(8)),
            ("mix1", _Mixer(8)),
            ("head", _Head(8, 32)),
        ]
    return LayeredModel("tuples", blocks, "lm", vocab_size=32)


def test_tuple_outputs_are_measured_and_counted_in_full() -> None:
    batch, seq = 3, 5
    profile = measure(_tuple_model(), batch, seq_len=seq, warmup=0, repeats=1)
    hidden, ids, mask = batch * seq * 8 * 4, batch * seq * 8, batch * seq * 1
    assert [la.output_bytes for la in profile.layers] == [
        hidden + ids + mask,
        hidden + ids + mask,
        hidden + ids + mask,
        batch * seq * 32 * 4,
    ]
    estimated = estimate(meta_copy(_tuple_model()), batch, seq_len=seq)
    assert [la.output_bytes for la in estimated.layers] == [
        la.output_bytes for la in profile.layers
    ]
    assert [la.saved for la in estimated.layers] == [la.saved for la in profile.layers]


def test_only_floating_tuple_members_carry_a_gradient_and_gradients_are_exact() -> None:
    model = _tuple_model()
    inputs, targets = model.example_batch(3, seq_len=5)
    model.loss(model(inputs), targets).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.mix0.seen.clear()
    run_step(model, inputs, targets)
    assert model.mix0.seen == [[True, False, False]]  # hidden yes; ids and mask never
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name  # bitwise


def test_a_block_returning_something_else_is_refused_by_name() -> None:
    class _Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"x": x}

    blocks = [
        ("fc", nn.Sequential(nn.Flatten(), nn.Linear(4, 4))),
        ("wrap", _Dict()),
        ("head", nn.Linear(4, 2)),
    ]
    model = LayeredModel("dicts", blocks, "classify", num_classes=2, in_channels=4)
    with pytest.raises(PipeswapError, match="block 'wrap' of dicts returns dict.*tuple of tensors"):
        measure(model, 2, image_size=1, warmup=0, repeats=1)


# ---- 3. autocast: the profile names what a real step saves ------------------------------


class _SeparateQKV(nn.Module):
    """Attention with three Linears reading one input (autocast casts it once per Linear)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # [B, T, W] each
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(x.shape[-1])  # [B, T, T]
        return x + self.out(scores.softmax(-1) @ v)


def _qkv_model() -> LayeredModel:
    torch.manual_seed(0)
    blocks = [
        ("embed", nn.Embedding(64, 16)),
        ("attn0", _SeparateQKV(16)),
        ("attn1", _SeparateQKV(16)),
        ("head", nn.Linear(16, 64)),
    ]
    return LayeredModel("qkv", blocks, "lm", vocab_size=64)


def _autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _every_tensor_swapped(profile: Profile) -> SwapPlan:
    names = profile.layer_names
    decisions = tuple(
        SwapDecision(
            layer.name,
            saved.index,
            saved.bytes,
            layer.name,
            names[i + 1] if i + 1 < len(names) else None,
        )
        for i, layer in enumerate(profile.layers)
        for saved in layer.saved
    )
    return SwapPlan(
        "hand",
        profile.model,
        tuple(names),
        (GpuPlan("gpu0", 0, 10**12, 0.0, decisions),),
        batch=profile.batch,
        dtype=profile.dtype,
        seq_len=profile.seq_len,
    )


def test_autocast_profile_saves_what_a_real_step_saves_and_its_plan_runs() -> None:
    batch, seq = 4, 8
    with _autocast():
        profile = measure(_qkv_model(), batch, seq_len=seq, warmup=0, repeats=1)

    model = _qkv_model()
    inputs, targets = model.example_batch(batch, seq_len=seq)
    inputs = inputs.clone()  # compact, as the profiler's batch

    def forward_loss() -> torch.Tensor:
        with _autocast():
            return model.loss(model(inputs), targets)

    records, _ = capture_records(model, forward_loss)
    for layer in profile.layers:
        assert [(s.index, s.bytes) for s in layer.saved] == [
            (r.index, r.bytes) for r in records[layer.name]
        ], layer.name
    # Three Linears read attn1's input: a real step casts it three times, equal casts
    # that are kept once (pipeswap.profiling.cast_twins), in the profile as in the run.
    # The second [B*T, W] cast is the input of the output projection.
    casts = [r for r in records["attn1"] if r.shape == (batch * seq, 16)]
    assert [r.dtype for r in casts] == ["bfloat16"] * 2
    assert profile.notes["autocast"] == "bfloat16"

    forward_loss().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    plan = _every_tensor_swapped(profile)
    executor = SwapExecutor(model, plan, profile=profile)
    _, stats = executor.train_step(forward_loss)  # the plan is accepted: prepare() checks it
    executor.close()
    assert stats.swapped_bytes == profile.saved_bytes == plan.gpus[0].swapped_bytes
    for name, param in model.named_parameters():
        assert torch.equal(param.grad, expected[name]), name  # swapping changed no bit


# ---- any nn.Module ------------------------------------------------------------------------


def test_a_plain_module_is_profiled_at_its_blocks_and_left_as_found() -> None:
    torch.manual_seed(0)
    net = TinyLM()
    before = {n: p.detach().clone() for n, p in net.state_dict().items()}
    rng = torch.random.get_rng_state()
    profile = measure(net, 2, seq_len=8, repeats=1, warmup=0)
    assert profile.layer_names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert all(layer.saved for layer in profile.layers[1:])
    estimated = estimate(net, 2, seq_len=8)
    assert [layer.name for layer in estimated.layers] == profile.layer_names
    assert all(torch.equal(before[n], t) for n, t in net.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in net.parameters()) and net.training


def test_what_is_not_a_module_is_refused() -> None:
    with pytest.raises(PipeswapError, match="measure.*nn.Module.*list"):
        measure([1, 2], 2, image_size=1)  # type: ignore[arg-type]
    with pytest.raises(PipeswapError, match="estimate.*nn.Module.*list"):
        estimate([1, 2], 2, image_size=1)  # type: ignore[arg-type]
