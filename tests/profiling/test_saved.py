"""Tests of saved-tensor capture and naming (pipeswap.profiling.saved)."""

import torch
from torch import nn

from pipeswap.models import build_model
from pipeswap.models.base import LayeredModel
from pipeswap.profiling.saved import SavedTensorCapture, capture_saved, storage_key
from pipeswap.swap.runtime.capture import capture_records


class QKBlock(nn.Module):
    """Splits one projection into two views and multiplies them: both views, one storage."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.proj(x).chunk(2, dim=-1)  # two views of one [B, 2W] storage
        return q * k


def _relu_linear(device: str = "cpu") -> LayeredModel:
    with torch.device(device):
        blocks = [
            ("a", nn.Sequential(nn.Linear(4, 8), nn.ReLU())),
            ("b", nn.Linear(8, 3)),
        ]
    return LayeredModel("toy", blocks, "classify", num_classes=3, in_channels=4)


def _summary(records: dict) -> dict:
    return {
        layer: [(r.index, r.bytes, r.shape, r.also_saved_by) for r in recs]
        for layer, recs in records.items()
    }


def test_hand_model_by_hand() -> None:
    model = _relu_linear()
    records = capture_saved(model, torch.randn(2, 4))
    # a's Linear saves its input x [2, 4]; its ReLU saves its output r [2, 8], which b's
    # Linear saves again: b's backward needs r first, so b owns it. Weights never appear.
    assert _summary(records) == {
        "a": [(0, 32, (2, 4), ())],
        "b": [(0, 64, (2, 8), ("a",))],
    }


def test_meta_and_cpu_agree_on_a_hand_model() -> None:
    cpu = capture_saved(_relu_linear("cpu"), torch.randn(2, 4))
    meta = capture_saved(_relu_linear("meta"), torch.empty(2, 4, device="meta"))
    assert cpu == meta


def test_views_of_one_storage_count_once_at_storage_size() -> None:
    model = LayeredModel("qk", [("qk", QKBlock(8))], "classify", num_classes=8, in_channels=8)
    records = capture_saved(model, torch.randn(3, 8))
    # Saved: the input x [3, 8] (for the Linear) and q, k, two views of the [3, 16] output.
    assert _summary(records) == {"qk": [(0, 96, (3, 8), ()), (1, 192, (3, 8), ())]}


def test_tied_parameters_are_excluded_in_every_layer() -> None:
    model = build_model("gpt2-micro", tie_embeddings=True)
    tokens, targets = model.example_batch(2, seq_len=8)
    with SavedTensorCapture(model) as capture:
        model.loss(model(tokens), targets)
    weight = storage_key(model.embed.tokens.weight)
    assert model.head.lm.weight is model.embed.tokens.weight
    calls = capture.pack_calls()
    # The head's matmul packs the tied weight: a pack call, but no saved tensor.
    assert None in calls["head"]
    assert weight in capture._resident
    for layer, recs in capture.records().items():
        assert [r.index for r in recs] == list(range(len(recs)))
        assert all(r.bytes > 0 for r in recs), layer


def test_pack_calls_name_every_saved_tensor() -> None:
    model = _relu_linear()
    with SavedTensorCapture(model) as capture:
        model(torch.randn(2, 4))
    calls = capture.pack_calls()
    # a: the Linear packs x only (x needs no gradient, so the weight is not needed), the
    # ReLU packs r (owned by b). b: the Linear packs r, then its weight (r needs a gradient).
    assert calls == {"a": [("a", 0), ("b", 0)], "b": [("b", 0), None]}


def test_liveness_peaks_at_the_turn_and_drains_in_backward() -> None:
    model = build_model("gpt2-micro")
    tokens, targets = model.example_batch(2, seq_len=16)
    with SavedTensorCapture(model) as capture:
        loss = model.loss(model(tokens), targets)
    total = sum(r.bytes for recs in capture.records().values() for r in recs)
    assert capture.live_bytes == capture.peak_live_bytes == total
    loss.backward()
    del loss
    assert capture.live_bytes == 0
    assert capture.peak_live_bytes == total


def test_loss_tensors_belong_to_the_last_layer() -> None:
    model = build_model("gpt2-micro")
    tokens, targets = model.example_batch(2, seq_len=16)
    without = capture_saved(model, tokens)
    with_loss = capture_saved(model, tokens, targets)
    assert without["block1"] == with_loss["block1"]
    extra = with_loss["head"][len(without["head"]) :]
    # cross_entropy keeps log-softmax [B*T, V] (float32), the targets (int64) and a scalar.
    assert [r.bytes for r in extra] == [2 * 16 * 256 * 4, 2 * 16 * 8, 4]


def test_zoo_models_agree_between_cpu_and_meta() -> None:
    for name, shape in (("gpt2-micro", {"seq_len": 16}), ("resnet-micro", {"image_size": 32})):
        cpu_model = build_model(name)
        meta_model = build_model(name, device="meta")
        cpu_in = [t.clone() for t in cpu_model.example_batch(2, **shape)]
        meta_in = meta_model.example_batch(2, device="meta", **shape)
        assert capture_saved(cpu_model, *cpu_in) == capture_saved(meta_model, *meta_in), name


def test_a_named_forward_without_a_backward_frees_what_it_saved() -> None:
    """The capture keeps a detached alias: the output a Tanh saves keeps its grad_fn, and a
    holder of the tensor itself would be kept alive by that node (a cycle through C++ that
    Python's collector cannot see), with every activation of the pass (on CUDA: prepare()
    held a whole forward's activations for the rest of the run)."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = build_model("gpt2-micro")
    outputs: list[weakref.ref[torch.Tensor]] = []
    hook = model.block0.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    x, _ = model.example_batch(2, seq_len=8, seed=0)
    with SavedTensorCapture(model) as capture:
        model(x).sum()
    hook.remove()
    gc.collect()
    assert capture.records()["block0"]  # it did save tensors
    assert outputs[0]() is None


def test_what_a_forward_saves_before_the_first_layer_is_freed_without_a_backward() -> None:
    """A naming pass runs forwards that no backward follows: an output saved before the
    first layer (tanh saves its output) must not be kept alive by its own grad_fn."""
    import gc
    import weakref

    model = _relu_linear()
    for release in (True, False):
        x = torch.randn(2, 4, requires_grad=True)
        with SavedTensorCapture(model, release=release):
            stem = torch.tanh(x)
            out = model(stem)
        alive = weakref.ref(stem)
        del stem, out
        gc.collect()
        assert alive() is None, release


class _Bridged(nn.Module):
    """Two layers with the model's own code between them (a bridge) and after them (a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bridge = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        t = torch.tanh(self.bridge(h).exp())  # saves h, bridge(h).exp(), and t
        return self.head(self.b(t)).sum()  # b saves t again; the head saves b's output


def test_what_code_between_two_layers_saves_belongs_to_the_later_one() -> None:
    """That code's backward runs after the later layer's and before the earlier layer's
    begins: a storage it saved (the earlier layer's output included, which the bridge
    saves) is the later layer's, listing the earlier one where it saved it too. What
    the head saves after the last layer stays the last layer's."""
    model = _Bridged()
    records, calls = capture_records(model, lambda: model(torch.randn(2, 4)), ["a", "b"])
    a, b = records["a"], records["b"]
    assert [(r.shape, r.given) for r in a] == [((2, 4), True)]  # a's input, the batch
    # b: h and exp's output (the bridge's), t (the bridge's tanh and b's Linear), b's
    # output (the head's).
    assert [(r.shape, r.also_saved_by) for r in b] == [
        ((2, 8), ()),
        ((2, 8), ()),
        ((2, 8), ()),
        ((2, 8), ()),
    ]
    # The runtime meets the bridge's packs while "a" is the running layer: named as b's
    # (None: a weight).
    assert calls["a"] == [("a", 0), ("b", 0), None, ("b", 1), ("b", 2)]
    assert calls["b"] == [("b", 2), None, ("b", 3), None]
