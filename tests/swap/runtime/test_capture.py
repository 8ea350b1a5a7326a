"""Naming a module's saved tensors as the profiler does, with and without recomputed layers.

Covers: pipeswap/swap/runtime/capture.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from user_models import USER_LAYERS, UserNet

from pipeswap.errors import PipeswapError
from pipeswap.models import build_model
from pipeswap.profiling.saved import CapturedSavedTensor, storage_key
from pipeswap.swap.runtime.capture import (
    InnerSaves,
    capture_records,
    kept_key,
    resolve_layers,
    step_names,
)
from pipeswap.swap.runtime.recompute_sizes import measure_recomputation


def test_layers_are_named_submodules_in_the_order_given() -> None:
    model = UserNet()
    layers = resolve_layers(model, USER_LAYERS)
    assert list(layers) == USER_LAYERS and layers["head"] is model.head
    with pytest.raises(PipeswapError, match="names no layers of its own: pass its layers"):
        resolve_layers(model, None)
    with pytest.raises(PipeswapError, match="list of layers is empty"):
        resolve_layers(model, [])
    with pytest.raises(PipeswapError, match="no submodule 'encoder.9'.*'encoder.0'"):
        resolve_layers(model, ["encoder.9"])
    with pytest.raises(PipeswapError, match="'head' is listed twice"):
        resolve_layers(model, ["head", "head"])


def test_every_pack_call_is_named_and_parameters_are_not() -> None:
    model = UserNet()
    x = torch.randn(8, 16)
    records, pack_calls = capture_records(model, lambda: model(x).sum(), USER_LAYERS)
    assert list(records) == list(pack_calls) == USER_LAYERS
    named = {key for calls in pack_calls.values() for key in calls if key is not None}
    assert named == {(layer, r.index) for layer, recs in records.items() for r in recs}
    # The weights the Linear layers save for their backward are never named.
    assert all(None in pack_calls[layer] for layer in ("encoder.2", "mixer", "head"))


def test_the_capture_leaves_batchnorm_statistics_untouched() -> None:
    torch.manual_seed(0)
    model = build_model("resnet18", image_size=32)
    x, y = model.example_batch(2, image_size=32, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    capture_records(model, lambda: model.loss(model(x), y))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _record(layer: str, index: int, nbytes: int) -> CapturedSavedTensor:
    return CapturedSavedTensor(layer, index, nbytes, (nbytes // 4,), "float32")


def test_a_recomputed_layers_kept_input_gets_its_own_name() -> None:
    # Layer b is recomputed: its own two tensors vanish; what it still saves (its input,
    # kept by the recomputation wrapper) is named as b's kept tensor.
    plain = (
        {"a": [_record("a", 0, 100)], "b": [_record("b", 0, 200), _record("b", 1, 50)]},
        {"a": [("a", 0), None], "b": [("b", 0), ("b", 1)]},
    )
    recomputing = ({"a": [_record("a", 0, 100)], "b": [_record("b", 0, 100)]},)
    recomputing += ({"a": [("a", 0), None], "b": [("b", 0)]},)
    names = step_names(plain, recomputing, ["b"])
    assert kept_key("b", 0) == ("b (kept)", 0)
    assert names.pack_calls == {"a": [("a", 0), None], "b": [("b (kept)", 0)]}
    assert names.sizes[("b (kept)", 0)] == 100 and names.sizes[("b", 1)] == 50
    assert names.kept_bytes == {"b": 100}
    changed = (recomputing[0], {"a": [("a", 0)], "b": [("b", 0)]})
    with pytest.raises(PipeswapError, match="saved 2 tensors in a plain forward but 1"):
        step_names(plain, changed, ["b"])


def test_a_rerun_saves_everything_but_its_inputs() -> None:
    inner = InnerSaves()
    inner.begin("b", {1})
    inner.saved["b"][-1].update({1: 100, 2: 200, 3: 50})
    inner.owner = {1: "a", 2: "b", 3: "c"}  # storage 3 is b's output, owned by c
    assert inner.rerun_bytes("b") == 250
    assert inner.rerun_bytes("b", own=True) == 200
    assert inner.rerun_bytes("a") == 0


def test_a_layer_called_several_times_re_runs_one_call_at_a_time() -> None:
    """ALBERT's one shared layer runs 4 times a forward: each call re-runs right before its
    own backward, so a re-run holds one call's saves, not every call's at once (the smallest
    budget of such a layer was named 2.4x what its plan measured)."""
    inner = InnerSaves()
    for call, (given, made) in enumerate([(1, 2), (3, 4), (5, 6)]):
        inner.begin("b", {given})
        inner.saved["b"][-1].update({given: 100, made: 200 + call})  # its output: next input
    inner.owner = dict.fromkeys(range(1, 7), "b")
    assert inner.rerun_bytes("b") == 202  # the largest call's, its input left out


class _Attention(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(x @ x.transpose(-1, -2), dim=-1)  # saved by the matmul below
        return probs @ x, probs


class _ReturnsItsMaps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out, probs = self.attn(self.inp(x))
        return {"loss": out.pow(2).mean(), "probs": probs}


def test_a_saved_storage_the_forward_returns_is_marked_the_loss_aside() -> None:
    # A loop that holds the output keeps the maps on the device whatever a plan does with
    # them (pipeswap.training.loop_profile leaves them out of what plans may free).
    model = _ReturnsItsMaps()
    x = torch.randn(2, 6, 8)
    records, _ = capture_records(model, lambda: model(x), ["inp", "attn"])
    returned = [(r.layer, r.bytes) for recs in records.values() for r in recs if r.returned]
    assert returned == [("attn", 2 * 6 * 6 * 4)]
    assert sum(len(recs) for recs in records.values()) > 1


def test_a_saved_storage_the_model_s_code_holds_past_the_next_layer_is_kept_alive() -> None:
    """A block's input the model keeps in a variable to its forward's end (BERT's
    embeddings output, which a LoRA on the first block's query saves) is ``kept_alive``:
    a swap of it frees nothing. One the next block's output replaces is not."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(32, 32)
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            kept = h = self.embed(x)  # held here to the end, and saved by block 0
            for block in self.blocks:
                h = torch.tanh(block(h))
            return (h + kept).square().sum()

    model = Net()
    x = torch.randn(8, 32)
    records, _ = capture_records(model, lambda: model(x), ["blocks.0", "blocks.1", "blocks.2"])
    alive = [
        (name, r.index, r.bytes) for name, recs in records.items() for r in recs if r.kept_alive
    ]
    assert alive == [("blocks.0", 0, 8 * 32 * 4)]
    assert not any(r.given for recs in records.values() for r in recs)


def test_a_recomputed_layer_keeps_no_more_than_what_the_model_holds_anyway() -> None:
    """A U-Net's skips are kept by the model until its decoder reads them, and every
    encoder block after the first keeps one as its input when recomputed: counted as kept
    as well as where the meter reads them, the plan recomputing every block overstated its
    peak by 2 MiB more than before (19315476 for 16112272 measured)."""
    torch.manual_seed(0)

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            conv = nn.Conv2d
            self.enc = nn.ModuleList(nn.Sequential(conv(8, 8, 3, padding=1)) for _ in range(3))
            self.dec = nn.ModuleList(nn.Sequential(conv(16, 8, 3, padding=1)) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            skips = []
            for block in self.enc:
                x = torch.relu(block(x))
                skips.append(x)
            for block in self.dec:
                x = torch.relu(block(torch.cat([x, skips.pop()], 1)))
            return x.square().mean()

    model = UNet()
    x = torch.randn(2, 8, 16, 16)
    names = [f"enc.{i}" for i in range(3)] + [f"dec.{i}" for i in range(3)]
    layers = dict(model.named_modules())
    sizes = measure_recomputation(model, {n: layers[n] for n in names}, names, lambda: model(x))
    # enc.0's input is the batch the caller holds; enc.1's, the first skip the model holds
    # until its last decoder block: neither keeps anything more (each kept 16384 before).
    assert sizes.kept["enc.0"] == sizes.kept["enc.1"] == 0
    assert sizes.kept["dec.0"] > 0  # its input, the concatenation, no one else holds


def test_a_rerun_s_output_counts_its_gradient_where_the_layer_owns_its_output() -> None:
    """Its output's gradient, where the layer owns the output (its own last op saves it, or
    the head's code, and no later layer); where a later layer owns it, or none saves it, the
    forward's working set read it alive, which covers the gradient."""
    inner = InnerSaves()
    out = torch.zeros(4, requires_grad=True)  # its gradient 16 B
    for owner, expected in ((None, 0), ("b", 0), ("a", 16)):
        inner.begin("a", set())
        inner.returned("a", (out, torch.zeros(2)))  # a tensor with no graph has no gradient
        if owner is not None:
            inner.owner[storage_key(out)] = owner
        assert inner.output_bytes("a") == expected, owner
        inner.inputs.clear(), inner.saved.clear(), inner.outputs.clear(), inner.owner.clear()
