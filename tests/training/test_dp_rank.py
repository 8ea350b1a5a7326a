"""Data-parallel training with swapping or recomputation: every plan trains bit for bit like
no swapping.

Covers: pipeswap/training/dp_rank.py, pipeswap/training/dp_result.py,
pipeswap/training/data_parallel.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import toy_layer, toy_profile_of
from torch import nn
from user_models import DROPOUT_LAYERS, USER_LAYERS, DropoutNet, UserNet

from pipeswap.checkpoint import CheckpointConfig
from pipeswap.config_fields import replace_fields
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.models.registry import build_model
from pipeswap.optim import OptimizerConfig
from pipeswap.profiling.measure import measure
from pipeswap.profiling.profile import Profile, SavedTensor
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.plan.planner import make_plan
from pipeswap.swap.plan.workload import workload_from_profile
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.swap.swap_config import POLICY_NAMES as POLICIES
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.data_parallel import PlanPayload
from pipeswap.training.data_parallel import report as build_report
from pipeswap.training.dp_rank import train_rank as _train_rank
from pipeswap.training.dp_result import RankResult
from pipeswap.training.job import ModelJob
from pipeswap.training.run import train

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
]

# What the rank loop reads of a config: steps, accumulate, the optimizer and the device.
SETTINGS = TrainConfig(
    "rank-loop", steps=2, device="cpu", swap=SwapConfig(), optim=OptimizerConfig(optimizer="sgd")
)


def train_rank(*args: Any, **kwargs: Any) -> RankResult:
    """One CPU thread per rank, so runs on this machine are comparable bit for bit."""
    return _train_rank(*args, threads=1, **kwargs)


@dataclass(frozen=True)
class UserJob:
    """A Job for UserNet, with its layers named by the user."""

    batch_size: int = 8

    @property
    def layers(self) -> Sequence[str]:
        return USER_LAYERS

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return UserNet().to(device)

    def loss(self, model: nn.Module, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output, targets)

    def batch(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(1000 + index + (0 if split == "train" else 10**6))
        return torch.randn(self.batch_size, 16, generator=gen), torch.randint(
            0, 5, (8,), generator=gen
        )


@dataclass(frozen=True)
class DropoutJob(UserJob):
    """A Job for DropoutNet: dropout draws from the (seed, step, micro-batch, rank) streams."""

    seed: int = 7

    @property
    def layers(self) -> Sequence[str]:
        return DROPOUT_LAYERS

    def build(self, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return DropoutNet().to(device)


def _user_profile(job: UserJob) -> Profile:
    """A profile of UserNet: real saved tensors, made-up times (it is not in the zoo)."""
    model = job.build(torch.device("cpu"))
    x, y = job.batch(0)
    outputs: dict[str, int] = {}

    def note(name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            outputs.setdefault(name, out.nbytes)

        return hook

    hooks = [model.get_submodule(name).register_forward_hook(note(name)) for name in job.layers]
    records, _ = capture_records(model, lambda: job.loss(model, model(x), y), job.layers)
    for hook in hooks:
        hook.remove()
    layers = (
        toy_layer(
            name,
            1e-3,
            2e-3,
            param_bytes=sum(p.numel() * 4 for p in model.get_submodule(name).parameters()),
            output_bytes=outputs[name],  # what a checkpoint of the next layer keeps
            saved=[SavedTensor(r.index, r.bytes) for r in records[name]],
        )
        for name in job.layers
    )
    params = sum(p.numel() * 4 for p in model.parameters())
    return toy_profile_of(
        layers,
        model="user",
        batch=job.batch_size,
        source="measured",
        device="cpu",
        optimizer_state_bytes=params,
    )


JOBS: dict[str, Any] = {
    "gpt2-tiny": ModelJob("gpt2-tiny", 4, seq_len=32),
    "resnet18": ModelJob("resnet18", 2, image_size=32),
    "user": UserJob(),
}
# Hand-made recompute plans run on these (small: every kind of plan on each, 1 and 2 ranks).
RECOMPUTE_JOBS: dict[str, Any] = {
    "gpt2-micro": ModelJob("gpt2-micro", 4, seq_len=32),
    "resnet-micro": ModelJob("resnet-micro", 4, image_size=32),
    "user": UserJob(),
    "dropout": DropoutJob(),
}


@functools.cache
def _profile(name: str) -> Profile:
    job = JOBS.get(name) or RECOMPUTE_JOBS[name]
    if isinstance(job, UserJob):
        return _user_profile(job)
    return measure(
        job.model,
        job.batch_size,
        seq_len=job.seq_len,
        image_size=job.image_size,
        warmup=0,
        repeats=1,
    )


def _plans(name: str, gpus: int, sync_every: int = 1) -> dict[str, SwapPlan]:
    """A plan per policy; the budget halfway between what can never move and the peak
    (ResNet-18 on 32-pixel images is mostly weights, so a footprint ratio would not do)."""
    workload = workload_from_profile(_profile(name))
    peak, smallest = workload.no_swap_peak_bytes(), workload.min_budget_bytes()
    plans = {}
    for policy in POLICIES:
        budget = peak if policy == "none" else (peak + smallest) // 2
        result = make_plan(
            _profile(name),
            preset("switch-4"),
            policy=policy,
            gpus=gpus,
            gpu_memory_bytes=budget,
            sync_every=sync_every,
            time_limit_s=10,
        )
        if result.fits and (name, policy) not in KNOWN_REFUSED:
            plans[policy] = result.plan  # a baseline that ignores the budget may not fit it
    return plans


# The planner's model has a recomputed layer keep only its input. UserNet's layers are
# single Linears that save only their input, and the ops between them (Tanh, GELU, ReLU:
# not inside any listed layer, so not recomputed) keep theirs: recomputing frees nothing,
# and the executor, which measures what each layer keeps, refuses the budget (policy finer
# only recomputes, so the same holds for it).
KNOWN_REFUSED = {("user", "recompute"), ("user", "finer")}


def test_a_recompute_plan_whose_layers_keep_what_they_save_is_refused() -> None:
    workload = workload_from_profile(_profile("user"))
    budget = (workload.no_swap_peak_bytes() + workload.min_budget_bytes()) // 2
    plan = make_plan(
        _profile("user"), preset("switch-4"), policy="recompute", gpus=1, gpu_memory_bytes=budget
    ).plan
    assert plan.gpus[0].recompute
    with pytest.raises(PipeswapError, match="with its swaps and recomputation a step needs"):
        train_rank(JOBS["user"], plan, SETTINGS, profile=_profile("user"))


def _check_against_none(results: dict[str, Sequence[RankResult]], where: str) -> None:
    expected = results["none"]
    for policy, ranks in results.items():
        for got, want in zip(ranks, expected):
            assert got.losses == want.losses, (where, policy, got.rank)
            assert got.params_sha256 == want.params_sha256, (where, policy, got.rank)
            assert got.peak_saved_bytes <= got.saved_budget_bytes, (where, policy, got.rank)
            assert got.late_fetches == 0, (where, policy)
        assert len({r.params_sha256 for r in ranks}) == 1  # the ranks agree


@pytest.mark.parametrize("name", list(JOBS))
def test_single_process_every_policy_matches_no_swapping(name: str) -> None:
    results = {}
    for policy, plan in _plans(name, 1).items():
        result = train_rank(JOBS[name], plan, SETTINGS, profile=_profile(name))
        results[policy] = [result]
        assert result.swapped_bytes == plan.gpus[0].swapped_bytes
        assert result.recomputed_layers == len(plan.gpus[0].recompute)
        if policy != "none" and _must_move(name):
            assert result.swapped_bytes > 0 or result.recomputed_layers > 0, policy
            assert result.peak_saved_bytes < results["none"][0].peak_saved_bytes, policy
    _check_against_none(results, name)


def _must_move(name: str) -> bool:
    """Whether the budget of _plans is below the no-swap peak: not where the optimizer
    step, which no plan changes, is the step's peak (ResNet-18 on 32-pixel images)."""
    workload = workload_from_profile(_profile(name))
    return workload.no_swap_peak_bytes() > workload.min_budget_bytes()


def test_single_process_report_has_every_field() -> None:
    plan = _plans("gpt2-tiny", 1)["disjoint"]
    result = train_rank(
        JOBS["gpt2-tiny"], plan, replace_fields(SETTINGS, steps=3), profile=_profile("gpt2-tiny")
    )
    config = TrainConfig("gpt2-tiny", batch=4, seq_len=32, steps=3).resolved()
    payload = PlanPayload(
        predicted_step_s=plan.predicted_iteration_s, lower_bound_s=0.0, topology="switch-4"
    )
    report = build_report(config, plan, payload, [result]).to_json()
    assert report["format"] == "pipeswap.train/2" and report["mode"] == "data-parallel"
    for key in (
        "losses",
        "step_s",
        "params_sha256",
        "peak_resident_bytes",
        "budget_bytes",
        "swapped_bytes",
        "late_fetches",
        "predicted_step_s",
        "measured_step_s",
    ):
        assert key in report
    assert report["losses"] == list(result.losses) == report["losses_per_rank"][0]
    assert report["predicted_step_s"] == plan.predicted_iteration_s > 0
    assert report["measured_step_s"] > 0 and len(report["params_sha256"]) == 64


def test_accumulation_changes_the_data_not_the_transparency() -> None:
    settings = replace_fields(SETTINGS, accumulate=2)
    plans = _plans("gpt2-tiny", 1, sync_every=2)
    none = train_rank(JOBS["gpt2-tiny"], plans["none"], settings, profile=_profile("gpt2-tiny"))
    swapped = train_rank(
        JOBS["gpt2-tiny"], plans["disjoint"], settings, profile=_profile("gpt2-tiny")
    )
    assert (none.losses, none.params_sha256) == (swapped.losses, swapped.params_sha256)
    single = train_rank(
        JOBS["gpt2-tiny"], _plans("gpt2-tiny", 1)["none"], SETTINGS, profile=_profile("gpt2-tiny")
    )
    assert single.params_sha256 != none.params_sha256  # two micro-batches per step: other data
    assert swapped.swapped_bytes == 2 * plans["disjoint"].gpus[0].swapped_bytes


# ---- recomputation ----------------------------------------------------------------------
RECOMPUTE_KINDS = ("none", "recompute", "mixed", "save-on-cpu")


def _hand_plan(name: str, kinds: Sequence[str]) -> SwapPlan:
    """A plan by hand, one kind per rank: ``recompute`` every layer; ``mixed``: every other
    layer, the others' tensors swapped just in time; ``save-on-cpu``: every tensor swapped."""
    profile = _profile(name)
    layers = profile.layer_names
    gpus = []
    for rank, kind in enumerate(kinds):
        recompute = {"recompute": layers, "mixed": layers[::2]}.get(kind, [])
        swaps = tuple(
            SwapDecision(
                layer.name,
                t.index,
                t.bytes,
                layer.name,
                layers[i + 1] if i + 1 < len(layers) else None,
            )
            for i, layer in enumerate(profile.layers)
            if kind != "none" and layer.name not in recompute
            for t in layer.saved
        )
        gpus.append(GpuPlan(f"gpu{rank}", rank, 10**12, 0.0, swaps, tuple(recompute)))
    return SwapPlan("+".join(kinds), profile.model, tuple(layers), tuple(gpus))


def _check_recompute_results(
    by_case: dict[str, list[RankResult]], plans: dict[str, SwapPlan]
) -> None:
    """Every plan ends with the no-swap run's weights, buffers and losses, on every rank."""
    for label, ranks in by_case.items():
        name = label.split("/")[0]
        expected = by_case[f"{name}/none"]
        for got, want in zip(sorted(ranks, key=lambda r: r.rank), expected):
            assert (got.losses, got.params_sha256) == (want.losses, want.params_sha256), label
            assert got.buffers_sha256 == want.buffers_sha256, label  # BatchNorm statistics
            assert got.late_fetches == 0, label
            gpu = plans[label].gpus[got.rank]
            assert got.swapped_bytes == gpu.swapped_bytes, label
            assert got.recomputed_layers == len(gpu.recompute), label
            assert (got.recomputed_bytes > 0) == (bool(gpu.recompute) and name != "user"), label
        assert len({r.params_sha256 for r in ranks}) == 1, label  # the ranks agree


@pytest.mark.parametrize("name", list(RECOMPUTE_JOBS))
def test_single_process_recompute_plans_match_no_swapping(name: str) -> None:
    plans = {f"{name}/{kind}": _hand_plan(name, [kind]) for kind in RECOMPUTE_KINDS}
    by_case = {
        label: [train_rank(RECOMPUTE_JOBS[name], plan, SETTINGS, profile=_profile(name))]
        for label, plan in plans.items()
    }
    _check_recompute_results(by_case, plans)
    if name in ("gpt2-micro", "resnet-micro", "dropout"):  # UserNet's layers keep only inputs
        full = by_case[f"{name}/none"][0].peak_saved_bytes
        assert by_case[f"{name}/recompute"][0].peak_saved_bytes < full


def test_the_report_records_what_was_recomputed() -> None:
    plan = _hand_plan("gpt2-micro", ["mixed"])
    result = train_rank(
        RECOMPUTE_JOBS["gpt2-micro"], plan, SETTINGS, profile=_profile("gpt2-micro")
    )
    config = TrainConfig("gpt2-micro", batch=4, seq_len=32, steps=2).resolved()
    payload = PlanPayload(predicted_step_s=0.0, lower_bound_s=0.0, topology="switch-4")
    report = build_report(config, plan, payload, [result]).to_json()
    assert report["recompute"] == [list(plan.gpus[0].recompute)]
    assert (
        report["recomputed_layers"] == [len(plan.gpus[0].recompute)] == [result.recomputed_layers]
    )
    assert report["recomputed_bytes"] == [result.recomputed_bytes] and result.recomputed_bytes > 0
    assert report["swapped_bytes"] == [plan.gpus[0].swapped_bytes]


@pytest.mark.dist
def test_two_ranks_recompute_plans_match_no_swapping() -> None:
    # Both ranks under one kind, and ranks with different kinds (a rank may recompute what
    # the other swaps): the all-reduced weights must still be the no-swap run's.
    kinds = [[k, k] for k in RECOMPUTE_KINDS] + [["recompute", "mixed"], ["save-on-cpu", "mixed"]]
    plans = {
        f"{name}/{'+'.join(pair) if pair[0] != pair[1] else pair[0]}": _hand_plan(name, pair)
        for name in RECOMPUTE_JOBS
        for pair in kinds
    }
    cases = [
        (label, RECOMPUTE_JOBS[label.split("/")[0]], plan, SETTINGS, _profile(label.split("/")[0]))
        for label, plan in plans.items()
    ]
    launched = spawn(_rank_cases, 2, cases, timeout_s=120)
    assert launched.ok, launched.exit_codes
    by_case: dict[str, list[RankResult]] = {}
    for rank_results in launched.results:
        for label, result in rank_results:
            by_case.setdefault(label, []).append(result)
    assert set(by_case) == set(plans) and all(len(r) == 2 for r in by_case.values())
    _check_recompute_results(by_case, plans)


# ---- several ranks (gloo) ---------------------------------------------------------------
def _rank_cases(
    rank: int, nproc: int, cases: list[tuple[str, Any, SwapPlan, TrainConfig, Profile]]
) -> list[tuple[str, RankResult]]:
    torch.set_num_threads(1)
    return [
        (label, train_rank(job, plan, settings, rank=rank, world_size=nproc, profile=profile))
        for label, job, plan, settings, profile in cases
    ]


def _failing_rank(rank: int, nproc: int, job: Any, plan: SwapPlan, profile: Profile) -> None:
    train_rank(job, plan, SETTINGS, rank=rank, world_size=nproc, profile=profile)


@pytest.mark.slow  # make test-slow; make test keeps a smaller case of it
@pytest.mark.dist
def test_two_ranks_every_policy_every_model_match_no_swapping() -> None:
    cases = []
    for name, job in JOBS.items():
        for policy, plan in _plans(name, 2).items():
            cases.append((f"{name}/{policy}", job, plan, SETTINGS, _profile(name)))
    accumulate = replace_fields(SETTINGS, accumulate=2)
    for policy, plan in _plans("gpt2-tiny", 2, sync_every=2).items():
        if policy in ("none", "bidirectional"):
            cases.append(
                (f"k2/{policy}", JOBS["gpt2-tiny"], plan, accumulate, _profile("gpt2-tiny"))
            )
    launched = spawn(_rank_cases, 2, cases, timeout_s=60)
    assert launched.ok, launched.exit_codes
    by_case: dict[str, list[RankResult]] = {}
    for rank_results in launched.results:
        for label, result in rank_results:
            by_case.setdefault(label, []).append(result)
    for name in (*JOBS, "k2"):
        results = {
            label.split("/")[1]: sorted(ranks, key=lambda r: r.rank)
            for label, ranks in by_case.items()
            if label.startswith(name + "/")
        }
        _check_against_none(results, name)
    # The bidirectional plan delays a rank, and the delay was applied.
    plan_of = {label: plan for label, _, plan, _, _ in cases}
    offsets = [r.offset_s for r in by_case["gpt2-tiny/bidirectional"]]
    assert offsets == [g.offset_s for g in plan_of["gpt2-tiny/bidirectional"].gpus]
    # Gradient accumulation still all-reduces: both ranks end with the same weights.
    assert len({r.params_sha256 for r in by_case["k2/none"]}) == 1
    assert by_case["k2/none"][0].params_sha256 != by_case["gpt2-tiny/none"][0].params_sha256


@pytest.mark.dist
def test_a_plan_one_rank_cannot_keep_fails_every_rank_without_a_hang() -> None:
    plan = _plans("gpt2-tiny", 2)["disjoint"]
    squeezed = GpuPlan(plan.gpus[1].gpu, 1, 1000, 0.0, plan.gpus[1].swaps)  # rank 1 only
    bad = replace(plan, gpus=(plan.gpus[0], squeezed))
    launched = spawn(
        _failing_rank, 2, JOBS["gpt2-tiny"], bad, _profile("gpt2-tiny"), timeout_s=30, grace_s=20
    )
    assert launched.exit_codes == (2, 2)  # both raised PipeswapError
    assert not launched.killed and launched.elapsed_s < 30


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_single_rank_matches_no_swapping_and_reports_allocator_peak() -> None:
    # Activations well above the weights, so the step's peak is where swapping acts.
    job = ModelJob("gpt2-tiny", 16, seq_len=256)
    profile = measure(
        "gpt2-tiny", job.batch_size, seq_len=job.seq_len, device="cuda", warmup=0, repeats=1
    )
    settings = replace(SETTINGS, steps=3, device="cuda")
    results = {}
    for policy in ("none", "oblivious"):
        ratio = 1.0 if policy == "none" else 1.3
        plan = make_plan(
            profile,
            preset("switch-4"),
            policy=policy,
            gpus=1,
            footprint_ratio=ratio,
            time_limit_s=20,
        ).plan
        results[policy] = train_rank(job, plan, settings, profile=profile)
    plain, swapped = results["none"], results["oblivious"]
    assert (swapped.losses, swapped.params_sha256) == (plain.losses, plain.params_sha256)
    assert swapped.swapped_bytes > 0 and plain.swapped_bytes == 0
    # On CUDA the peak is the allocator's, which swapping lowers.
    assert swapped.peak_resident_bytes < plain.peak_resident_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_hugging_face_llama_in_bf16_holds_its_budget_and_runs_without_one(
    tmp_path: Path,
) -> None:
    """`pipeswap train --device cuda` on an HF Llama in bf16: the allocator's peak is within
    the plan's budget x 1.02; with no swapping and no budget it runs on any GPU (the budget is
    the GPU's memory as torch reports it, not nvidia-smi's larger total)."""
    import json

    from pipeswap.cli import main
    from tests.models.hf_configs import save_model

    source = save_model(
        tmp_path / "llama",
        "llama",
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=1024,
    )
    common = ["train", "--model", source, "--device", "cuda", "--precision", "bf16-mixed"]
    common += ["--batch", "8", "--seq-len", "1024", "--steps", "3", "--optimizer", "adamw"]
    report = tmp_path / "r.json"
    assert main([*common, "--swap-policy", "none", "--report", str(report)]) == 0
    plain = json.loads(report.read_text())["peak_resident_bytes"][0]
    argv = [*common, "--swap-policy", "hybrid", "--footprint-ratio", "1.5", "--report", str(report)]
    assert main(argv) == 0
    swapped = json.loads(report.read_text())
    assert swapped["peak_resident_bytes"][0] <= swapped["budget_bytes"] * 1.02
    assert swapped["peak_resident_bytes"][0] < plain


@pytest.mark.parametrize("clip, bound", [(1e-3, True), (None, False)])
def test_clipping_bounds_the_first_update_by_lr_times_the_norm(
    tmp_path: Path, clip: float | None, bound: bool
) -> None:
    optim = OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad_norm=clip)
    save = CheckpointConfig(save=str(tmp_path / "out"))
    config = TrainConfig("gpt2-micro", batch=4, seq_len=16, steps=1, optim=optim, checkpoint=save)
    train(config)
    after = load_file(tmp_path / "out" / "model.safetensors")
    before = build_model("gpt2-micro", seed=0).state_dict()
    moved = torch.sqrt(sum(((after[k] - before[k]) ** 2).sum() for k in after))
    # SGD's first step is lr * g: clipped, its norm is at most lr * clip.
    assert (float(moved) <= 0.05 * 1e-3 * (1 + 1e-5)) is bound


def test_held_out_batches_are_scored_in_eval_mode_after_training_and_change_nothing() -> None:
    def run(**fields: Any) -> Any:
        config = TrainConfig(
            "gpt2-micro", batch=4, seq_len=16, steps=2, device="cpu", swap=SwapConfig()
        )
        # The footprint ratio below was set for SGD's one state buffer.
        fields = {"optimizer": "sgd", **fields}
        outcome = train(replace_fields(config, progress=False, **fields))
        assert outcome is not None
        return outcome.report

    plain = run(policy="none")
    swapped = run(policy="hybrid", footprint_ratio=1.3)
    unscored = run(policy="none", eval_batches=0)
    assert plain.data_parallel.eval["batches"] == 2 and plain.data_parallel.eval["loss"] > 0
    assert swapped.data_parallel.eval == plain.data_parallel.eval
    assert unscored.data_parallel.eval == {"batches": 0}
    assert unscored.params_sha256 == plain.params_sha256  # scoring trains nothing
    # The zoo's image models report accuracy too, over every rank's held-out samples.
    image = run(model="resnet-micro", seq_len=None, batch=4, nproc=2, policy="none")
    assert 0.0 <= image.data_parallel.eval["accuracy"] <= 1.0


@pytest.mark.slow  # make test-slow; make test keeps a smaller case of it
def test_scores_every_n_steps_change_nothing_and_equal_a_shorter_runs_end() -> None:
    def run(**fields: Any) -> Any:
        config = TrainConfig(
            "resnet-micro", batch=4, steps=4, nproc=2, device="cpu", swap=SwapConfig()
        )
        outcome = train(replace_fields(config, progress=False, policy="none", **fields))
        assert outcome is not None
        return outcome.report

    scored, plain, shorter = run(eval_every=2), run(), run(steps=2)
    assert scored.params_sha256 == plain.params_sha256  # BatchNorm statistics included
    assert scored.losses == plain.losses and scored.data_parallel.eval == plain.data_parallel.eval
    # After step 2: the weights of a 2-step run, every rank's batches, in eval mode.
    assert scored.evals == [{"step": 2, **shorter.data_parallel.eval}]
    assert plain.evals == []
