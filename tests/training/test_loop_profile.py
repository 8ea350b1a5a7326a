"""pipeswap/training/loop_profile.py: a user's loop as the planner sees it."""

from __future__ import annotations

import re
import warnings
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.profiling.metered_step import metered_step
from pipeswap.profiling.saved import CapturedSavedTensor
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.learning import LEARNT_BY, learning_step
from pipeswap.swap.runtime.recompute_sizes import RecomputeSizes
from pipeswap.training.loop_calls import without_cache
from pipeswap.training.loop_profile import loop_profile
from pipeswap.training.offload import offload


def test_parameters_outside_the_layers_count_with_the_first_and_the_batch_is_the_first_tensor() -> (
    None
):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    layers = {"0": model[0], "1": model[1]}  # the last Linear is outside them
    timing = BlockTiming(
        forward_s={"0": 0.1, "1": 0.2},
        output_bytes={"0": 64, "1": 64},
        backward_started={"0": 1.0, "1": 0.7},
        ended=1.5,
    )
    records = {
        "0": [CapturedSavedTensor("0", 0, 64, (4, 4), "float32")],
        "1": [CapturedSavedTensor("1", 0, 64, (4, 4), "float32")],
    }
    profile = loop_profile(
        model,
        layers,
        RecomputeSizes(records, {"0": 16}, {"0": 48}, {"0": 48}, {}, {}),
        timing,
        ((torch.zeros(5, 4),), {}),
        optimizer="sgd",
        memory=None,
    )
    per_linear = (16 + 4) * 4
    assert [layer.param_bytes for layer in profile.layers] == [per_linear + 40, per_linear]
    assert profile.batch == 5 and profile.optimizer_state_bytes == profile.param_bytes
    assert [layer.backward_s for layer in profile.layers] == pytest.approx([0.5, 0.3])
    assert (profile.layers[0].kept_bytes, profile.layers[1].kept_bytes) == (16, None)


def test_a_learnt_step_reads_what_the_step_as_it_is_holds() -> None:
    """A 4-layer HF Llama at 40 tokens: the profile from a step learnt with every saved
    storage on the host plans for what the step as it is holds."""
    pytest.importorskip("transformers")
    from tests.training.test_loop_shapes import _llama, padded_batches

    model = _llama()
    planner = offload(model, gpu_memory="1GiB").planner
    batch = without_cache(padded_batches(1, 40, 40)[0])
    sizes = planner.name_tensors((), batch)
    peaks = {}
    for how in LEARNT_BY:
        timing = BlockTiming()  # the learnt step tells its marks what the host holds
        with planner.quiet():
            metered_step(
                model,
                lambda: model(**batch),
                planner.layers,
                planner.device,
                holding=(*planner.holding, batch),
                around=lambda: learning_step(how, model, planner.layers, timing),  # noqa: B023
                timing=timing,
            )
        profile = loop_profile(
            model,
            planner.layers,
            sizes,
            timing,
            ((), batch),
            optimizer="adamw",
            memory=timing.step_memory(planner.layer_names),
        )
        workload = workload_from_profile(profile)
        peaks[how] = (workload.no_swap_peak_bytes(), workload.min_budget_bytes())
    # On the host every reading is the step's as it is, to the byte (the marks are told
    # of each saved storage the device lets go of and takes back).
    assert peaks["on-host"] == peaks["as-is"]


def test_a_loop_holding_outputs_its_layers_save_keeps_the_budget() -> None:
    """An eager Llama asked for its attention maps returns what the matmul after each
    softmax saves: a loop that holds its outputs through the backward keeps the maps on
    the device whatever a plan does with them. Counted as saved tensors, swapping them
    freed nothing and every planned step held 1.13x the budget, which check_memory blamed
    on a second backward; the profile leaves them out of what plans can free."""
    pytest.importorskip("transformers")
    from tests.training.test_loop_shapes import VOCAB, _llama

    def run(planned: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], Any, list[int]]:
        model = _llama(attention="eager")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        off = (
            offload(model, footprint_ratio=1.5, optimizer=opt, check_memory=True)
            if planned
            else None
        )
        g = torch.Generator().manual_seed(1)
        losses, peaks = [], []
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (4, 64), generator=g)
            pools = [] if off is None else off.host_pools()
            meter = DeviceMeter("cpu", holding=(model, opt, ids), exclude=pools)
            with meter:
                with off or nullcontext():
                    out = model(input_ids=ids, labels=ids, output_attentions=True)
                out.loss.backward()  # (the maps held through it, as ``out`` holds them)
                opt.step()
                opt.zero_grad()
                losses.append(out.loss.detach())
                del out
            peaks.append(meter.peak)
        return losses, [p.detach() for p in model.parameters()], off, peaks

    plain_losses, plain_weights, _, _ = run(False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        losses, weights, off, peaks = run(True)
    stats = off.stats()
    assert stats["planned_shape"] is not None and stats["swapped_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(losses, plain_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert max(peaks[1:]) <= stats["budget_bytes"] * 1.02, (peaks, stats["budget_bytes"])
    assert not [w for w in said if "pipeswap.offload" in str(w.message)]


@pytest.mark.parametrize("policy", ["auto", "disjoint"])
def test_the_tensors_a_loop_calls_its_model_with_are_never_counted_as_freed(policy: str) -> None:
    """A loop that makes ``inputs_embeds`` itself holds them through the backward, and the
    first layer saves them: swapping them freed nothing, and every planned step held
    1.0087x the budget (exactly the embeddings' bytes over the prediction)."""
    pytest.importorskip("transformers")
    from tests.training.test_loop_shapes import VOCAB, _llama

    def run(planned: bool) -> tuple[list[float], list[torch.Tensor], Any, list[int]]:
        model = _llama(hidden=128)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        off = offload(model, footprint_ratio=1.5, optimizer=opt, policy=policy) if planned else None
        g = torch.Generator().manual_seed(1)
        losses, peaks = [], []
        for _ in range(4):
            ids = torch.randint(0, VOCAB, (4, 128), generator=g)
            pools = [] if off is None else off.host_pools()
            with DeviceMeter("cpu", holding=(model, opt, ids), exclude=pools) as meter:
                embeds = model.get_input_embeddings()(ids)
                with off or nullcontext():
                    loss = model(inputs_embeds=embeds, labels=ids).loss
                loss.backward()  # (``embeds`` held through it)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            peaks.append(meter.peak)
        return losses, [p.detach() for p in model.parameters()], off, peaks

    plain_losses, plain_weights, _, _ = run(False)
    losses, weights, off, peaks = run(True)
    stats = off.stats()
    assert stats["planned_shape"] is not None and stats["swapped_bytes"] > 0
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert max(peaks[1:]) <= stats["budget_bytes"], (peaks, stats["budget_bytes"])
    off.close()


class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(8, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t() @ self.b.t()) * 2.0


@pytest.mark.parametrize("policy", ["auto", "disjoint"])
def test_a_saved_tensor_the_models_code_holds_on_is_never_counted_as_freed(policy: str) -> None:
    """BERT keeps its embeddings' output in a variable while its encoder runs, and a LoRA
    on the first block's query saves it: swapped, it freed nothing, and every planned step
    held 1.0138x the budget (one [4, 128, 128] float32 storage over the prediction at each
    later block's forward)."""
    transformers = pytest.importorskip("transformers")

    def run(planned: bool) -> tuple[list[float], list[torch.Tensor], Any, list[int]]:
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=2,
            intermediate_size=512, max_position_embeddings=128, num_labels=3,
            attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.BertForSequenceClassification(config).requires_grad_(False)
        for layer in model.bert.encoder.layer:
            layer.attention.self.query = _LoRA(layer.attention.self.query)
            layer.attention.self.value = _LoRA(layer.attention.self.value)
        model.classifier.requires_grad_(True)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        off = offload(model, footprint_ratio=1.5, optimizer=opt, policy=policy) if planned else None
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(123)  # the dropouts' masks
        losses, peaks = [], []
        for _ in range(4):
            batch = {
                "input_ids": torch.randint(0, 512, (4, 128), generator=g),
                "labels": torch.randint(0, 3, (4,), generator=g),
            }
            pools = [] if off is None else off.host_pools()
            with DeviceMeter("cpu", holding=(model, opt, batch), exclude=pools) as meter:
                with off or nullcontext():
                    loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            peaks.append(meter.peak)
        return losses, [p.detach() for p in model.parameters()], off, peaks

    plain_losses, plain_weights, _, _ = run(False)
    losses, weights, off, peaks = run(True)
    stats = off.stats()
    assert stats["swapped_bytes"] > 0 and losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert max(peaks[1:]) <= stats["budget_bytes"], (peaks, stats["budget_bytes"])
    off.close()


class _Bridged(nn.Module):
    """An encoder, a wide bridge of the model's own code, and a decoder reading the
    encoder's output too (an encoder-decoder's shape)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.bridge_up = nn.Linear(64, 512)
        self.bridge_down = nn.Linear(512, 64)
        self.decoder = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            x = x + block(x)
        y = self.bridge_down(torch.tanh(self.bridge_up(x)))
        for block in self.decoder:
            y = y + block(y + x)
        return y.pow(2).mean()


def test_what_code_between_two_layers_saves_is_back_for_the_later_layers_backward() -> None:
    """The bridge's saved tensors were filed under the encoder's last layer, whose backward
    the plan brought them back for; the bridge's backward needs them earlier, in the
    decoder's first layer's, beside what that layer holds: 1.22x the budget at ratio 2.
    Filed under the decoder's first layer, it is planned or refused naming the smallest,
    which holds (plain SGD's state, none, counted as none: the smallest is the step's)."""

    def run(**budget: Any) -> tuple[list[float], list[int], dict[str, Any]]:
        model = _Bridged()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        layers = [f"{stack}.{i}" for stack in ("encoder", "decoder") for i in range(3)]
        off = offload(model, optimizer=opt, policy="disjoint", layers=layers, **budget)
        g = torch.Generator().manual_seed(1)
        losses, peaks = [], []
        for _ in range(3):
            x = torch.randn(16, 64, 64, generator=g)
            pools = off.host_pools() if budget else []
            with DeviceMeter("cpu", holding=(model, opt, x), exclude=pools) as meter:
                with off if budget else nullcontext():
                    loss = model(x)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            peaks.append(meter.peak)
        stats = off.stats()
        off.close()
        return losses, peaks, stats

    budget: dict[str, Any] = {"footprint_ratio": 2.0}
    try:
        losses, peaks, stats = run(**budget)
    except ConfigError as refused:
        smallest = int(re.search(r"smallest budget that works is (\d+)", str(refused))[1])
        budget = {"gpu_memory": smallest}
        losses, peaks, stats = run(**budget)
    assert stats["swapped_bytes"] > 0 and losses == run()[0]  # bit-identical to plain
    assert max(peaks[1:]) <= stats["budget_bytes"], (peaks, stats["budget_bytes"])
    if "gpu_memory" in budget:  # the smallest named is what the step needs, not more
        assert max(peaks[1:]) >= 0.98 * stats["budget_bytes"]
