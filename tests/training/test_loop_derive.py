"""A new shape planned before its first step, its profile derived from the shapes measured.

Covers: pipeswap/training/loop_derive.py (and offload's use of it through loop_shapes),
and the naming forward that lets go of what it saves (pipeswap/profiling/saved.py's
``release``, which pipeswap/swap/runtime/capture.py uses).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from pipeswap.models.blocks import find_blocks
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.profiling.profile import Profile
from pipeswap.profiling.saved import SavedTensorCapture
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.capture import _LayerView, capture_records, resolve_layers
from pipeswap.training.loop_calls import Signature, modes_of, signature, without_cache
from pipeswap.training.loop_derive import (
    Scaling,
    derive_profile,
    features,
    fit,
    gradient_bytes,
    name_call,
)
from pipeswap.training.offload import Offload, offload
from tests.training.test_loop_shapes import (
    CPU,
    _llama,
    _loop,
    _same,
    metered_loop,
    padded_batches,
)

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_padded_loop_runs_only_its_first_step_unplanned() -> None:
    """51 steps of 30 and more lengths on one GPU's budget (two thirds of the longest
    step's no-swap peak): the first step is learnt (its saved tensors on the host), every other
    runs a plan made before its forward, and every step keeps the budget by the meter."""
    data = padded_batches(1, 16, 16, rows=2) + padded_batches(50, 8, 96, rows=2)
    assert len({batch["input_ids"].shape[1] for batch in data}) >= 30
    plain = metered_loop(_llama(), nullcontext, data)
    model = _llama()
    budget = int(max(plain[2]) / 1.5)
    off = offload(model, gpu_memory=budget)
    seen: list[dict[str, Any]] = []
    swapped = metered_loop(
        model, lambda: off, data, off.host_pools, lambda: seen.append(off.stats())
    )
    assert _same(plain, swapped)
    assert seen[0]["planned_shape"] is None and off.stats()["learning_steps"] == 1
    assert "on the host" in seen[0]["learning"]
    assert all(step["planned_shape"] is not None for step in seen[1:])
    assert all(step["learning"] is None for step in seen[1:])
    planned = {seen[0]["shape"]}  # learnt, planned at the second step's forward
    derived = []  # the steps that planned their own shape at their forward
    for step in seen[1:]:
        if step["planned_shape"] not in planned:
            planned.add(step["planned_shape"])
            derived.append(step)
    assert len(derived) >= 3 and all(step["shape"] == step["planned_shape"] for step in derived)
    for step in derived:  # from the shape measured
        assert step["derived_from"] == "2x16, 2x16, 2x16"
        assert 0 < step["planning_s"] <= step["step_planning_s"]
    peaks = swapped[2]
    assert max(peaks) <= budget * 1.02, [round(peak / budget, 3) for peak in peaks]
    assert max(plain[2][1:]) > budget * 1.4  # the budget is a real cut


def test_a_batch_without_padding_is_planned_apart_even_under_plan_for() -> None:
    """Its mask is all ones, which the model drops (it saves other tensors): the padded
    plan does not serve it, and as it is no larger than plan_for's batch it is not
    refused either, but derived before its forward from plan_for's shape."""
    data = padded_batches(3, 40, 64)
    full = padded_batches(1, 48, 48)  # every row 48 long
    assert all(bool((batch["attention_mask"] == 0).any()) for batch in data)
    plain = _loop(_llama(layers=3), nullcontext, data + full, lr=1e-3)
    model = _llama(layers=3)
    off = offload(model, footprint_ratio=1.5)
    longest = max(data, key=lambda batch: batch["input_ids"].shape[1])
    off.plan_for(**longest)
    swapped = metered_loop(model, lambda: off, data + full, off.host_pools)
    assert _same(plain, swapped)
    stats = off.stats()
    width = longest["input_ids"].shape[1]
    assert stats["shape"] == stats["planned_shape"] == "4x48, 4x48, 4x48"
    assert stats["derived_from"] == ", ".join([f"4x{width}"] * 3)
    assert max(swapped[2]) <= stats["budget_bytes"] * 1.02


def test_a_derived_plan_whose_step_held_more_is_made_again_by_the_heuristics() -> None:
    model = _llama(layers=3)
    off = offload(model, footprint_ratio=1.2)  # auto: a search for the measured shape
    _loop(model, lambda: off, padded_batches(1, 40, 40) + padded_batches(1, 48, 48))
    (planned,) = [p for p in off.shapes.plans.values() if p.derived_from is not None]
    assert planned.derived_from == "4x40, 4x40, 4x40" and planned.heuristic == "hybrid"
    off.planner.measured(planned, planned.budget_bytes + 20_000)  # as the meter would say
    with pytest.warns(RuntimeWarning, match="planned again"):
        _loop(model, lambda: off, padded_batches(1, 48, 48))
    (again,) = [p for p in off.shapes.plans.values() if p.derived_from is not None]
    assert again.replans == 1 and again.result.policy == "hybrid"
    assert again.result.budget_bytes == planned.budget_bytes - 20_000


def _measured(off: Offload, length: int) -> tuple[Signature, Profile, dict[str, Any]]:
    """A shape measured (plan_for's step run aside): its signature, profile and call."""
    batch = without_cache(padded_batches(1, length, length)[0])
    off.plan_for(**batch)
    key = signature((), batch, CPU, modes_of(off.model))
    return key, off.shapes.plans[key].profile, batch


def _derived(
    off: Offload, bases: list[tuple[Signature, Profile, dict[str, Any]]], length: int
) -> tuple[Profile, Profile, Scaling]:
    """The shape of ``length`` derived from ``bases``, and as measured."""
    key, truth, batch = _measured(off, length)
    named = name_call(off.model, off.layers, (), batch)
    used = [(sig, profile) for sig, profile, _ in bases]
    derived = derive_profile(
        key,
        used,
        named.saved,
        named.outputs,
        later=gradient_bytes(off.layers, named.head),
        batch=4,
        source="test",
    )
    totals = {name: sum(t.bytes for t in tensors) for name, tensors in named.saved.items()}
    return derived, truth, Scaling(key, used, totals)


def _peaks(profile: Profile) -> tuple[int, int]:
    workload = workload_from_profile(profile)
    return workload.no_swap_peak_bytes(), workload.min_budget_bytes()


def test_from_one_measured_shape_each_layer_scales_by_its_saved_bytes() -> None:
    model = _llama()
    off = offload(model, gpu_memory="1GiB")
    short = _measured(off, 16)
    derived, truth, scaling = _derived(off, [short], 64)
    assert not scaling.fitting
    for new, measured, old in zip(derived.layers, truth.layers, short[1].layers, strict=True):
        # What it saves and outputs is named, not modelled.
        assert (new.saved, new.output_bytes) == (measured.saved, measured.output_bytes)
        ratio = new.saved_bytes / old.saved_bytes
        assert new.forward_s == pytest.approx(old.forward_s * ratio)
        assert new.kept_bytes == round((old.kept_bytes or 0) * ratio)
    # The memory it would hold, within a few per cent of the measured step's, never
    # much below (the gradients no shape changes are not scaled).
    for mine, real in zip(_peaks(derived), _peaks(truth), strict=True):
        assert real * 0.99 <= mine <= real * 1.06, (mine, real)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_from_two_measured_shapes_each_layer_is_fitted(attention: str) -> None:
    """Eager attention saves its T x T scores: the fit finds the quadratic term."""
    model = _llama(attention=attention)
    off = offload(model, gpu_memory="1GiB")
    bases = [_measured(off, 16), _measured(off, 40)]
    derived, truth, scaling = _derived(off, bases, 85)
    assert scaling.fitting
    points = [features(sig) for sig, _, _ in bases]
    for i, layer in enumerate(truth.layers):
        saved = [profile.layers[i].saved_bytes for _, profile, _ in bases]
        fitted = scaling.value(i, saved)
        assert fitted == pytest.approx(layer.saved_bytes, rel=1e-3)
        _, quadratic = fit([(n, q, y) for (n, q), y in zip(points, saved, strict=True)])
        assert (quadratic > 0) == (attention == "eager")
    for mine, real in zip(_peaks(derived), _peaks(truth), strict=True):
        assert real * 0.99 <= mine <= real * 1.03, (mine, real)


def test_the_fit_is_exact_on_its_model_and_never_negative() -> None:
    points = [(n, n * n / 4, 3 * n + 0.5 * n * n / 4) for n in (64.0, 160.0, 340.0)]
    assert fit(points) == pytest.approx((3.0, 0.5))
    a, b = fit([(64.0, 1024.0, 900.0), (340.0, 28900.0, 500.0)])  # smaller when larger
    assert a >= 0 and b >= 0


def test_naming_a_call_holds_no_more_than_a_forward_without_gradients() -> None:
    """No backward follows the naming forward: it lets each saved tensor go as the
    forward does, so naming a new shape before its step keeps the step's budget."""
    model = _llama()
    batch = without_cache(padded_batches(1, 96, 96)[0])
    names = find_blocks(model)

    def peak(run: Any) -> int:
        with DeviceMeter(CPU, holding=(model, batch)) as meter:
            run()
        return meter.peak

    def inference() -> None:
        with torch.no_grad():
            model(**batch)

    def training() -> Any:
        return model(**batch)  # the graph holds every saved tensor until it is dropped

    named = peak(lambda: capture_records(model, lambda: model(**batch), names))
    assert named <= peak(inference) * 1.05 < peak(training) * 0.6
    view = _LayerView(model, resolve_layers(model, names))
    with SavedTensorCapture(view, release=True):  # type: ignore[arg-type]
        loss = model(**batch).loss
    with pytest.raises(RuntimeError, match="let go of as the forward ran"):
        loss.backward()


def test_an_encoder_decoder_shape_with_longer_labels_is_derived_within_the_budget() -> None:
    """The turn (head, logits, loss) was scaled as the call's largest tensor, the source:
    labels longer than any measured, with a shorter source, put the derived plan 1.0107x
    over its budget (Marian; BART 1.0018x). It scales as the last layer, the decoder's."""
    import transformers

    def batch(g: torch.Generator, rows: int, source: int, target: int) -> dict[str, Any]:
        ids = torch.randint(3, 128, (rows, source), generator=g)
        mask = torch.ones_like(ids)
        ids[1:, source // 2 :], mask[1:, source // 2 :] = 1, 0
        labels = torch.randint(3, 128, (rows, target), generator=g)
        labels[1:, target // 2 :] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    config = transformers.MarianConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MarianMTModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = offload(model, footprint_ratio=1.3, optimizer=opt, policy="auto")
    g = torch.Generator().manual_seed(1)
    for shape in [(4, 48, 28), (4, 32, 20), (4, 32, 36)]:
        data = batch(g, *shape)
        with DeviceMeter("cpu", holding=(model, opt, data), exclude=off.host_pools()) as meter:
            with off:
                loss = model(**data).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    stats = off.stats()
    assert stats["derived_from"] == "4x48, 4x48, 4x28" and stats["shape"] == "4x32, 4x32, 4x36"
    assert meter.peak <= stats["budget_bytes"], (meter.peak, stats["budget_bytes"])
    off.close()
