"""SwapExecutor on CPU: bitwise-transparent training (swapped or recomputed), the budget kept,
errors that name the fix.

Covers: pipeswap/swap/runtime/executor.py (its checks and capture: test_checks.py, test_capture.py).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn
from user_models import DROPOUT_LAYERS, USER_LAYERS, DropoutNet, UserNet

from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.models import build_model
from pipeswap.models.adapt import adapt
from pipeswap.profiling.measure import measure
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.swap.runtime.checks import PLAN_SLACK
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.stats import StepStats
from pipeswap.swap.runtime.transfer import SwapTransfer
from pipeswap.swap.swap_config import POLICY_NAMES as POLICIES

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
]

STEPS = 3
HUGE = 10**12


def _setup(name: str) -> tuple[nn.Module, list[str] | None, Callable[[int], Any]]:
    """A model, its layers (None for zoo models) and a batch maker (deterministic)."""
    torch.manual_seed(0)
    if name == "user":
        model: nn.Module = UserNet()
        gen = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen))
            for _ in range(STEPS)
        ]
        return model, USER_LAYERS, lambda step: data[step]
    if name == "dropout":
        model = DropoutNet()
        gen = torch.Generator().manual_seed(1)
        data = [
            (torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen))
            for _ in range(STEPS)
        ]
        return model, DROPOUT_LAYERS, lambda step: data[step]
    if name == "hf-gpt2":
        transformers = pytest.importorskip("transformers")
        from tests.models.hf_configs import hf_config

        hf = adapt(
            transformers.GPT2LMHeadModel(hf_config("gpt2")), example=torch.zeros(1, 8).long()
        )
        ids = torch.randint(0, 256, (STEPS, 4, 16), generator=torch.Generator().manual_seed(1))
        return hf, None, lambda step: (ids[step], ids[step].roll(-1, 1))
    if name.startswith("resnet"):
        zoo = build_model(name, image_size=32)
        batch = 2 if name == "resnet18" else 4
        batches = [zoo.example_batch(batch, image_size=32, seed=s) for s in range(STEPS)]
    else:
        zoo = build_model(name)
        batches = [zoo.example_batch(4, seq_len=32, seed=s) for s in range(STEPS)]
    # Compact storages, as a copy to the device gives (and as the profiler measures).
    batches = [(x.clone(memory_format=torch.contiguous_format), y.clone()) for x, y in batches]
    return zoo, None, lambda step: batches[step]


def _loss_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    loss = getattr(model, "loss", None)
    return loss if loss is not None else nn.functional.cross_entropy


def _sha256(model: nn.Module) -> str:
    """Parameters and buffers (BatchNorm statistics), bit for bit."""
    digest = hashlib.sha256()
    for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()]):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _records(model: nn.Module, layers: list[str] | None, first: Any) -> dict[str, Any]:
    loss_of = _loss_fn(model)
    records, _ = capture_records(model, lambda: loss_of(model(first[0]), first[1]), layers)
    return records


def _hand_plan(
    model: nn.Module, layers: list[str], records: dict[str, Any], kind: str, budget: int = HUGE
) -> SwapPlan:
    """Hand-made plans: every tensor swapped, prefetched just in time, at the turn, late..."""
    decisions = []
    if kind != "none":
        for i, layer in enumerate(layers):
            for record in records[layer]:
                later = layers[i + 1] if i + 1 < len(layers) else None
                out_after = {"out-late": layers[-1]}.get(kind, layer)
                prefetch = {"turn": None, "late": layer}.get(kind, later)
                if kind == "half" and record.index % 2:
                    continue
                decisions.append(
                    SwapDecision(layer, record.index, record.bytes, out_after, prefetch)
                )
    name = getattr(model, "name", "user")
    return SwapPlan(kind, name, tuple(layers), (GpuPlan("gpu0", 0, budget, 0.0, tuple(decisions)),))


def _train(
    model: nn.Module,
    batches: Callable[[int], Any],
    executor: SwapExecutor | None,
) -> tuple[list[float], str, list[StepStats]]:
    loss_of = _loss_fn(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, stats = [], []
    for step in range(STEPS):
        inputs, targets = batches(step)

        def forward_loss(inputs: torch.Tensor = inputs, targets: torch.Tensor = targets) -> Any:
            return loss_of(model(inputs), targets)

        if executor is None:
            loss = forward_loss()
            loss.backward()
        else:
            loss, step_stats = executor.train_step(forward_loss)
            stats.append(step_stats)
            assert executor.live_bytes == 0  # every saved byte let go after the backward
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, _sha256(model), stats


def _reference(name: str) -> tuple[list[float], str]:
    model, _, batches = _setup(name)
    losses, sha, _ = _train(model, batches, None)
    return losses, sha


KINDS = ["none", "jit", "turn", "out-late", "half", "late"]


@pytest.mark.parametrize("name", ["gpt2-tiny", "resnet18", "user"])
def test_hand_made_plans_train_bit_for_bit_like_plain_pytorch(name: str) -> None:
    expected = _reference(name)
    total_saved = None
    for kind in KINDS:
        model, layers, batches = _setup(name)
        records = _records(model, layers, batches(0))
        names = layers or list(model.layer_names)  # type: ignore[attr-defined]
        all_bytes = sum(r.bytes for layer in names for r in records[layer])
        plan = _hand_plan(model, names, records, kind)
        executor = SwapExecutor(model, plan, layers=layers)
        losses, sha, stats = _train(model, batches, executor)
        assert (losses, sha) == expected, kind
        swapped = sum(d.bytes for d in plan.gpus[0].swaps)
        assert all(s.swapped_bytes == swapped == s.prefetched_bytes for s in stats), kind
        peak = max(s.peak_saved_bytes for s in stats)
        if kind == "none":
            # Nothing swapped: every saved tensor is alive at the turn, and only then.
            assert peak == all_bytes
            total_saved = all_bytes
        elif kind in ("jit", "half"):
            assert peak < total_saved, kind  # swapping made room
        late = sum(s.late_fetches for s in stats)
        if kind == "late":
            # Prefetched only after their own layer's backward: each one is fetched late
            # (but the first layer's: its input needs no gradient, so its hook fires early).
            not_first = [d for d in plan.gpus[0].swaps if d.layer != names[0]]
            assert late == STEPS * len(not_first)
        else:
            assert late == 0, kind
        executor.close()


class _Blocks(nn.Module):
    """Three listed blocks and a head outside them: the head and loss are the turn."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_the_turn_s_prefetches_start_once_the_turn_s_backward_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan's timeline brings tensors prefetched "at the turn" back after the head, the
    loss and their backward (the turn's working set): issued at the forward's end instead,
    they would sit on the device beside that working set, which no budget counted. Those
    swapped out at the turn itself never leave in the timeline: they come back at once."""
    torch.manual_seed(0)
    model, layers = _Blocks(), ["blocks.0", "blocks.1", "blocks.2"]
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))

    def forward_loss() -> torch.Tensor:
        logits = model(x)
        logits.register_hook(lambda grad: events.append("the turn's backward"))
        return nn.functional.cross_entropy(logits, y)

    events: list[str] = []
    records, _ = capture_records(model, forward_loss, layers)
    executor = SwapExecutor(model, _hand_plan(model, layers, records, "turn"), layers=layers)
    executor.prepare(forward_loss)
    prefetch = SwapTransfer.prefetch

    def logged(transfer: SwapTransfer, entry: Any) -> bool:
        events.append(entry.key[0])
        return prefetch(transfer, entry)

    monkeypatch.setattr(SwapTransfer, "prefetch", logged)
    events.clear()
    with executor.forward():
        loss = forward_loss()
    assert events and set(events) == {"blocks.2"}  # out at the turn: never left
    loss.backward()
    stats = executor.finish_step()
    after = events[events.index("the turn's backward") + 1 :]
    assert set(after) == {"blocks.0", "blocks.1"}
    assert stats.late_fetches == 0
    executor.close()


# ---- recomputation ----------------------------------------------------------------------
def _recompute_plan(
    model: nn.Module, layers: list[str], records: dict[str, Any], kind: str, budget: int = HUGE
) -> SwapPlan:
    """``recompute``: every layer; ``mixed``: every other layer, the rest swapped just in
    time; ``save-on-cpu``: every saved tensor swapped, nothing recomputed; ``none``."""
    recompute = {"recompute": layers, "mixed": layers[::2]}.get(kind, [])
    decisions = [
        SwapDecision(layer, r.index, r.bytes, layer, layers[i + 1] if i + 1 < len(layers) else None)
        for i, layer in enumerate(layers)
        if layer not in recompute and kind != "none"
        for r in records[layer]
    ]
    name = getattr(model, "name", "user")
    gpu = GpuPlan("gpu0", 0, budget, 0.0, tuple(decisions), tuple(recompute))
    return SwapPlan(kind, name, tuple(layers), (gpu,))


@pytest.mark.parametrize("name", ["gpt2-micro", "resnet-micro", "user", "dropout"])
def test_recompute_plans_train_bit_for_bit_like_plain_pytorch(name: str) -> None:
    expected = _reference(name)
    expected_rng = torch.get_rng_state()
    all_bytes = None
    for kind in ("recompute", "mixed", "save-on-cpu"):
        model, layers, batches = _setup(name)
        names = layers or list(model.layer_names)  # type: ignore[attr-defined]
        records = _records(model, layers, batches(0))
        all_bytes = sum(r.bytes for layer in names for r in records[layer])
        plan = _recompute_plan(model, names, records, kind)
        executor = SwapExecutor(model, plan, layers=layers)
        losses, sha, stats = _train(model, batches, executor)
        # Weights, BatchNorm statistics, losses and the generator after training: dropout
        # drew the same masks, and the re-runs left the generator where it was.
        assert (losses, sha) == expected, kind
        assert torch.equal(torch.get_rng_state(), expected_rng), kind
        gpu = plan.gpus[0]
        rerun = sum(executor.rerun_bytes.values())
        for s in stats:
            assert s.recomputed_layers == len(gpu.recompute), kind
            assert s.recomputed_bytes == rerun, kind
            assert s.swapped_bytes == s.prefetched_bytes == gpu.swapped_bytes, kind
            assert s.late_fetches == 0, kind
        assert set(executor.rerun_bytes) == set(executor.kept_bytes) == set(gpu.recompute)
        if kind == "recompute" and name != "user":  # UserNet's layers save their input only
            assert rerun > 0 and max(s.peak_saved_bytes for s in stats) < all_bytes
        executor.close()
        assert not any("forward" in vars(model.get_submodule(n)) for n in names)


def test_recomputed_dropout_is_active_and_evaluation_runs_plain() -> None:
    model, layers, batches = _setup("dropout")
    x = batches(0)[0]
    torch.manual_seed(1)
    first = model(x)
    torch.manual_seed(2)
    assert not torch.equal(first, model(x))  # the masks matter: recomputing must redraw them
    records = _records(model, layers, batches(0))
    plan = _recompute_plan(model, DROPOUT_LAYERS, records, "recompute")
    with SwapExecutor(model, plan, layers=layers) as executor:
        _train(model, batches, executor)
        model.eval()
        with torch.no_grad():  # outside a step the layers run their plain forward
            out = model(x)
        assert out.grad_fn is None and executor.live_bytes == 0
        assert "forward" in vars(model.block0)
        with pytest.raises(PipeswapError, match="torch.no_grad.*evaluation outside"):
            with torch.no_grad(), executor.forward():
                pass
    assert "forward" not in vars(model.block0)  # leaving the block unwraps the layers
    with pytest.raises(PipeswapError, match="was closed .*make another"), executor.forward():
        pass


@pytest.mark.parametrize("name", ["gpt2-micro", "resnet-micro"])
def test_a_recompute_plan_keeps_the_tightest_budget_it_is_checked_against(name: str) -> None:
    model, _, batches = _setup(name)
    names = list(model.layer_names)  # type: ignore[attr-defined]
    records = _records(model, None, batches(0))
    first = batches(0)
    batch = first[0].shape[0]
    profile = (
        measure(name, batch, image_size=32, warmup=0, repeats=1)
        if name.startswith("resnet")
        else measure(name, batch, seq_len=32, warmup=0, repeats=1)
    )
    expected = _reference(name)

    def executor_for(kind: str, budget: int) -> SwapExecutor:
        model, _, batches = _setup(name)
        executor = SwapExecutor(
            model, _recompute_plan(model, names, records, kind, budget), profile=profile
        )
        executor.prepare(lambda: _loss_fn(model)(model(first[0]), first[1]))
        return executor

    needs = {}
    for kind in ("none", "save-on-cpu", "recompute", "mixed"):
        probe = executor_for(kind, HUGE)
        probe.close()
        assert probe.needed_bytes is not None
        needs[kind] = tight = probe.needed_bytes
        if kind in ("recompute", "mixed"):
            # The tightest budget the check lets through: the need less its slack.
            least = math.ceil(tight / (1 + PLAN_SLACK))
            with pytest.raises(PipeswapError, match="recomputation a step needs .* bytes"):
                executor_for(kind, least - 1)
        # Under the tightest budget the check lets through, the bytes held keep it.
        executor = executor_for(kind, tight)
        losses, sha, stats = _train(executor.model, lambda step: batches(step), executor)
        assert (losses, sha) == expected, kind
        assert max(s.peak_saved_bytes for s in stats) <= executor.saved_budget_bytes, kind
        executor.close()
    assert needs["recompute"] < needs["none"] and needs["mixed"] < needs["none"], needs


def test_a_tensor_autograd_let_go_in_the_forward_is_not_swapped_and_no_error() -> None:
    """A Hugging Face GPT-2's head re-runs the model's forward with its blocks stubbed: the
    position embedding it computes again saves its position ids in a branch whose result
    the stubs drop, so autograd lets go of them before the plan's swap-out at the turn.
    Every tensor swapped (save-on-cpu): the step trains as plain PyTorch does."""
    expected = _reference("hf-gpt2")
    model, layers, batches = _setup("hf-gpt2")
    names = list(model.layer_names)  # type: ignore[attr-defined]
    plan = _recompute_plan(model, names, _records(model, layers, batches(0)), "save-on-cpu")
    executor = SwapExecutor(model, plan, layers=layers)
    losses, sha, stats = _train(model, batches, executor)
    assert (losses, sha) == expected
    assert all(
        0 < s.swapped_bytes == s.prefetched_bytes < plan.gpus[0].swapped_bytes for s in stats
    )
    executor.close()


def test_recompute_refusals_name_the_fix() -> None:
    model, plan, (x, y) = _gpt_plan_and_model()
    gpu = plan.gpus[0]
    unknown = replace(plan, gpus=(replace(gpu, swaps=(), recompute=("blok1",)),))
    with pytest.raises(PipeswapError, match="recomputes layer 'blok1'.*did you mean 'block1'"):
        SwapExecutor(model, unknown)
    both = replace(plan, gpus=(replace(gpu, recompute=(gpu.swaps[0].layer,)),))
    with pytest.raises(PipeswapError, match="swapped, but its layer is recomputed"):
        SwapExecutor(model, both)
    # The plan's tensors are checked by name and size as without recomputation.
    mixed = _recompute_plan(model, list(plan.layers), _records(model, None, (x, y)), "mixed")
    executor = SwapExecutor(model, mixed)
    with pytest.raises(PipeswapError, match="made for another profile"):
        executor.prepare(lambda: model.loss(model(x[:2]), y[:2]))
    executor.close()
    nested = SwapPlan(
        "hand", "user", ("encoder", "head"), (GpuPlan("gpu0", 0, HUGE, 0.0, (), ("encoder",)),)
    )
    with pytest.raises(PipeswapError, match="contains layer 'encoder.0'"):
        SwapExecutor(
            UserNet(),
            replace(nested, layers=("encoder", "encoder.0", "head")),
            layers=["encoder", "encoder.0", "head"],
        )


def _profile_and_plans(footprint_ratio: float) -> tuple[Any, dict[str, SwapPlan]]:
    profile = measure("gpt2-tiny", 4, seq_len=32, warmup=0, repeats=1)
    topology = preset("switch-4")
    plans = {}
    for policy in POLICIES:
        ratio = 1.0 if policy == "none" else footprint_ratio
        result = make_plan(
            profile, topology, policy=policy, gpus=2, footprint_ratio=ratio, time_limit_s=20
        )
        if result.fits:  # a baseline that ignores the budget may not fit it: nothing to run
            plans[policy] = result.plan
    return profile, plans


def test_planned_policies_keep_the_budget_and_the_bits() -> None:
    expected = _reference("gpt2-tiny")
    profile, plans = _profile_and_plans(1.3)
    for policy, plan in plans.items():
        for rank in (0, 1):
            model, _, batches = _setup("gpt2-tiny")
            executor = SwapExecutor(model, plan, rank=rank, profile=profile)
            losses, sha, stats = _train(model, batches, executor)
            assert (losses, sha) == expected, (policy, rank)
            peak = max(s.peak_saved_bytes for s in stats)
            assert peak <= executor.saved_budget_bytes, (policy, rank, peak)
            gpu = plan.gpus[rank]
            assert stats[-1].swapped_bytes == gpu.swapped_bytes
            assert stats[-1].recomputed_layers == len(gpu.recompute)
            if policy != "none":
                assert gpu.swapped_bytes > 0 or gpu.recompute, (policy, rank)
            executor.close()


def test_host_pool_is_allocated_once_and_reused() -> None:
    model, _, batches = _setup("gpt2-tiny")
    first = batches(0)
    records, _ = capture_records(model, lambda: model.loss(model(first[0]), first[1]))
    plan = _hand_plan(model, model.layer_names, records, "jit")
    executor = SwapExecutor(model, plan)
    pointer = executor.pool.buffer.data_ptr()
    _train(model, batches, executor)
    assert executor.pool.allocations == 1
    assert executor.pool.buffer.data_ptr() == pointer
    assert executor.pool.region_bytes == sum(d.bytes for d in plan.gpus[0].swaps)
    assert not executor.pool.pinned  # plain host memory on the CPU


def test_parameters_are_never_among_the_swapped_storages() -> None:
    model, _, batches = _setup("gpt2-tiny")
    first = batches(0)
    records, pack_calls = capture_records(model, lambda: model.loss(model(first[0]), first[1]))
    # Every layer with weights saves them for its backward; the capture marks those None.
    assert any(None in calls for calls in pack_calls.values())
    named = {key for calls in pack_calls.values() for key in calls if key is not None}
    assert named == {(layer, r.index) for layer, recs in records.items() for r in recs}
    pointers = [p.data_ptr() for p in model.parameters()]
    plan = _hand_plan(model, model.layer_names, records, "jit")
    _train(model, batches, SwapExecutor(model, plan))
    assert [p.data_ptr() for p in model.parameters()] == pointers


# ---- errors -----------------------------------------------------------------------------
def _gpt_plan_and_model() -> tuple[nn.Module, SwapPlan, Any]:
    model, _, batches = _setup("gpt2-tiny")
    first = batches(0)
    records, _ = capture_records(model, lambda: model.loss(model(first[0]), first[1]))
    return model, _hand_plan(model, model.layer_names, records, "jit"), first


def test_a_plan_naming_a_missing_layer_lists_the_close_names() -> None:
    model, plan, _ = _gpt_plan_and_model()
    swaps = plan.gpus[0].swaps
    wrong = SwapDecision("blok1", 0, swaps[0].bytes, "blok1", "block2")
    bad = SwapPlan("hand", plan.model, plan.layers, (GpuPlan("gpu0", 0, HUGE, 0.0, (wrong,)),))
    with pytest.raises(PipeswapError, match="'blok1'.*did you mean 'block1'"):
        SwapExecutor(model, bad)
    renamed = SwapPlan("hand", plan.model, ("embed", "blocks0", *plan.layers[2:]), plan.gpus)
    with pytest.raises(PipeswapError, match="did you mean 'block0'"):
        SwapExecutor(model, renamed)
    with pytest.raises(PipeswapError, match="no submodule 'encoder.9'.*'encoder.0'"):
        SwapExecutor(UserNet(), plan, layers=["encoder.9", "head"])


def test_a_plan_made_for_another_profile_is_refused() -> None:
    model, plan, first = _gpt_plan_and_model()
    other = SwapPlan("hand", "gpt2-micro", plan.layers, plan.gpus)
    with pytest.raises(PipeswapError, match="made for model 'gpt2-micro'"):
        SwapExecutor(model, other)
    # Same model, another batch: the tensors' sizes give it away.
    executor = SwapExecutor(model, plan)
    half = first[0][:2], first[1][:2]
    with pytest.raises(PipeswapError, match="made for another profile"):
        executor.prepare(lambda: model.loss(model(half[0]), half[1]))
    executor.close()
    # Another dtype: the profile says float32, the model is bfloat16.
    profile = measure("gpt2-tiny", 4, seq_len=32, warmup=0, repeats=1)
    with pytest.raises(PipeswapError, match="float32 profile.*bfloat16"):
        SwapExecutor(build_model("gpt2-tiny", dtype=torch.bfloat16), plan, profile=profile)


def test_a_budget_the_plan_cannot_meet_says_by_how_much() -> None:
    model, _, batches = _setup("gpt2-tiny")
    first = batches(0)
    records, _ = capture_records(model, lambda: model.loss(model(first[0]), first[1]))
    total = sum(r.bytes for recs in records.values() for r in recs)
    # Beyond the slack a run's own sizes may take (PLAN_SLACK) by 1000 bytes.
    short = int(total / (1 + PLAN_SLACK)) - 1000
    plan = _hand_plan(model, model.layer_names, records, "none", budget=short)
    executor = SwapExecutor(model, plan)
    with pytest.raises(PipeswapError, match=f"needs .* bytes, {total - short} bytes .* more"):
        executor.prepare(lambda: model.loss(model(first[0]), first[1]))
    # The same budget with everything swapped just in time fits.
    fitting = _hand_plan(model, model.layer_names, records, "jit", budget=short)
    SwapExecutor(model, fitting).prepare(lambda: model.loss(model(first[0]), first[1]))


def test_a_rank_the_plan_does_not_cover_is_refused() -> None:
    model, plan, _ = _gpt_plan_and_model()
    with pytest.raises(PipeswapError, match="no part for rank 3"):
        SwapExecutor(model, plan, rank=3)


def test_steps_need_prepare_first_and_a_non_zoo_model_needs_layers() -> None:
    model, plan, first = _gpt_plan_and_model()
    executor = SwapExecutor(model, plan)
    with pytest.raises(PipeswapError, match="prepare"):
        with executor.forward():
            pass
    with pytest.raises(PipeswapError, match="list of submodule names"):
        SwapExecutor(UserNet(), plan)


def test_prepare_leaves_batchnorm_statistics_untouched() -> None:
    model, _, batches = _setup("resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = batches(0)
    capture_records(model, lambda: model.loss(model(first[0]), first[1]))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ---- CUDA -------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_swapping_is_transparent_and_saves_memory() -> None:
    device = torch.device("cuda")

    def run(kind: str | None) -> tuple[list[float], str, int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(8)])
        model.to(device)
        layers = [str(i) for i in range(8)]
        gen = torch.Generator().manual_seed(3)
        data = [
            (
                torch.randn(2048, 1024, generator=gen).to(device),
                torch.randint(0, 1024, (2048,), generator=gen).to(device),
            )
            for _ in range(3)
        ]
        executor = None
        if kind is not None:
            x0, y0 = data[0]
            records, _ = capture_records(
                model, lambda: nn.functional.cross_entropy(model(x0), y0), layers
            )
            # The budget may not exceed the GPU's memory (prepare refuses that).
            total = torch.cuda.get_device_properties(device).total_memory
            plan = _hand_plan(model, layers, records, kind, budget=total)
            executor = SwapExecutor(model, plan, layers=layers)
            executor.prepare(lambda: nn.functional.cross_entropy(model(x0), y0))
            assert executor.pool.pinned and not executor.account
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for x, y in data:

            def forward_loss(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return nn.functional.cross_entropy(model(x), y)

            if executor is None:
                loss = forward_loss()
                loss.backward()
            else:
                loss, _ = executor.train_step(forward_loss)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        digest = hashlib.sha256()
        for _, param in sorted(model.named_parameters()):
            digest.update(param.detach().cpu().numpy().tobytes())
        return losses, digest.hexdigest(), torch.cuda.max_memory_allocated()

    plain_losses, plain_sha, plain_peak = run(None)
    jit_losses, jit_sha, jit_peak = run("jit")
    late_losses, late_sha, _ = run("late")
    assert (jit_losses, jit_sha) == (plain_losses, plain_sha)
    assert (late_losses, late_sha) == (plain_losses, plain_sha)
    assert jit_peak < plain_peak


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_recompute_redraws_dropout_masks_and_saves_memory() -> None:
    device = torch.device("cuda")
    layers = [str(i) for i in range(8)]

    def run(recompute: tuple[str, ...]) -> tuple[list[float], str, int]:
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(1024, 1024), nn.Dropout(0.1), nn.GELU()) for _ in range(8)]
        ).to(device)
        gen = torch.Generator().manual_seed(3)
        data = [
            (
                torch.randn(2048, 1024, generator=gen).to(device),
                torch.randint(0, 1024, (2048,), generator=gen).to(device),
            )
            for _ in range(3)
        ]
        total = torch.cuda.get_device_properties(device).total_memory
        gpu = GpuPlan("gpu0", 0, total, 0.0, (), recompute)
        executor = SwapExecutor(
            model, SwapPlan("hand", "user", tuple(layers), (gpu,)), layers=layers
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.manual_seed(5)  # dropout draws from the GPU's generator
        for x, y in data:
            loss, stats = executor.train_step(
                lambda x=x, y=y: nn.functional.cross_entropy(model(x), y)
            )
            assert stats.recomputed_layers == len(recompute)
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        digest = hashlib.sha256()
        for _, param in sorted(model.named_parameters()):
            digest.update(param.detach().cpu().numpy().tobytes())
        executor.close()
        return losses, digest.hexdigest(), torch.cuda.max_memory_allocated()

    plain_losses, plain_sha, plain_peak = run(())
    losses, sha, peak = run(tuple(layers[:-1]))
    assert (losses, sha) == (plain_losses, plain_sha)
    assert peak < plain_peak


@pytest.mark.parametrize("kind", ["half", "jit"])
def test_a_forward_without_a_backward_frees_its_saved_tensors(kind: str) -> None:
    """What stays on the device is held by a detached alias (a saved output's grad_fn would
    keep the holder itself alive: a cycle the collector cannot see), so a step whose
    backward never runs lets go of everything, and so does prepare()'s naming pass."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    layers = [str(i) for i in range(4)]
    x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
    outputs: list[weakref.ref[torch.Tensor]] = []
    model[1].register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))

    def forward_loss() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x), y)

    records, _ = capture_records(model, forward_loss, layers)
    executor = SwapExecutor(model, _hand_plan(model, layers, records, kind), layers=layers)
    executor.prepare(forward_loss)
    with executor.forward():
        loss = forward_loss()
    del loss
    executor.finish_step()
    gc.collect()
    assert len(outputs) == 3 and all(ref() is None for ref in outputs)
