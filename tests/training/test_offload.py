"""pipeswap.offload in a loop of your own: bit-identical to the loop without it, any signature.

Covers: pipeswap/training/offload.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError
from pipeswap.training.offload import Offload, offload
from pipeswap.training.offload import offload as pipeswap_offload
from tests.models.hf_configs import hf_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, SEQ = 96, 16
# Four full batches, then a partial one (a loader's last batch): two shapes, two plans.
SIZES = (4, 4, 4, 4, 3, 4, 3)


def tiny(family: str) -> nn.Module:
    """A 3-block model of ``family`` (GPT-2 with dropout, so its random stream matters)."""
    torch.manual_seed(0)
    config = hf_config(family, dropout=0.1 if family == "gpt2" else 0.0, vocab_size=VOCAB)
    if family == "llama":
        config.num_hidden_layers = 3
        return transformers.LlamaForCausalLM(config)
    config.n_layer = 3
    return transformers.GPT2LMHeadModel(config)


def batches(sizes: tuple[int, ...] = SIZES) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for size in sizes:
        ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
        mask = torch.ones(size, SEQ, dtype=torch.long)
        mask[0, SEQ // 2 :] = 0  # a padded row: the mask reaches the attention
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    return out


def train_loop(
    model: nn.Module,
    wrap: Callable[[], AbstractContextManager[Any]],
    data: list[dict[str, torch.Tensor]],
    *,
    cast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[list[float], list[torch.Tensor]]:
    """A user's loop: AdamW, their batches as keyword arguments, the model's own loss."""
    torch.manual_seed(2)  # dropout
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in data:
        with cast(), wrap():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _equal(
    a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]
) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_plain_loop_is_bit_identical_with_offload_and_swaps(family: str) -> None:
    plain = train_loop(tiny(family), nullcontext, batches())
    model = tiny(family)
    off = offload(model, footprint_ratio=1.2, policy="bidirectional")
    swapped = train_loop(model, lambda: off, batches())
    assert _equal(plain, swapped)
    stats = off.stats()
    # The first step learns the shape; every other step ran its plan, the partial batches
    # (3 rows) the plan of 4 rows, which covers them.
    assert (stats["learning_steps"], stats["plans"], stats["steps"]) == (1, 1, len(SIZES) - 1)
    assert (stats["shape"], stats["planned_shape"]) == ("3x16, 3x16, 3x16", "4x16, 4x16, 4x16")
    assert stats["swapped_bytes"] > 0 and stats["policy"] == "bidirectional"
    assert stats["predicted_step_s"] > 0
    off.close()


def test_autocast_and_nothing_to_swap() -> None:
    def bf16() -> AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    plain = train_loop(tiny("llama"), nullcontext, batches(), cast=bf16)
    model = tiny("llama")
    off = offload(model, footprint_ratio=1.2, policy="disjoint")
    assert _equal(plain, train_loop(model, lambda: off, batches(), cast=bf16))
    assert off.stats()["swapped_bytes"] > 0
    roomy = offload(tiny("llama"), gpu_memory="64GiB", policy="disjoint")
    train_loop(roomy.model, lambda: roomy, batches())
    stats = roomy.stats()
    assert stats["swapped_bytes"] == 0 and stats["policy"] == "disjoint"


def test_bad_settings_are_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="gpu_memory '12 parsecs': unknown unit 'parsecs'"):
        offload(tiny("llama"), gpu_memory="12 parsecs")
    with pytest.raises(ConfigError, match="give gpu_memory or footprint_ratio, not both"):
        offload(tiny("llama"), gpu_memory="1GiB", footprint_ratio=2.0)
    tight = offload(tiny("llama"), gpu_memory=1000)
    with pytest.raises(ConfigError, match="pass gpu_memory [0-9]+ or more"):
        train_loop(tight.model, lambda: tight, batches())
    with pytest.raises(PipeswapError, match="layers="):
        offload(nn.Linear(3, 3))
    with pytest.raises(PipeswapError, match="no submodule 'nope'"):
        offload(tiny("gpt2"), layers=["nope"])


def _ddp_rank(rank: int, world: int, use: bool) -> tuple[list[float], list[torch.Tensor]] | None:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny("gpt2"))
    data = batches()  # every rank the same shapes at the same steps, as a sampler gives
    off = (
        offload(model, footprint_ratio=1.2, policy="bidirectional", check_memory=True)
        if use
        else None
    )
    out = train_loop(model, (lambda: off) if off is not None else nullcontext, data)
    if off is not None:
        stats = off.stats()
        assert stats["swapped_bytes"] > 0
        assert isinstance(off, Offload)
        # DDP's buckets, which a step run aside on the module cannot show, are counted.
        assert stats["step_peak_bytes"] <= stats["budget_bytes"] * 1.02, stats
    return out if rank == 0 else None


@pytest.mark.dist
def test_under_the_users_own_ddp_ranks_share_one_plan_and_stay_bit_identical() -> None:
    results = []
    for use in (False, True):
        launched = spawn(_ddp_rank, 2, use, timeout_s=120)
        assert launched.ok, launched.exit_codes
        results.append(launched.results[0])
    assert _equal(results[0], results[1])


def _ddp_lengths_rank(rank: int, world: int, use: bool) -> Any:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny("gpt2"))
    # A sampler's batches: rank 0 meets a larger shape alone, rank 1's are covered.
    data = batches((4, 4, 6, 6) if rank == 0 else (4, 4, 2, 2))
    off = (
        offload(model, footprint_ratio=1.2, policy="hybrid", on_infeasible="recompute-all")
        if use
        else None
    )
    return train_loop(model, (lambda: off) if off is not None else nullcontext, data)


@pytest.mark.dist
def test_under_ddp_a_shape_one_rank_meets_alone_is_planned_by_it_alone() -> None:
    """Each rank plans a later shape for itself: a collective only one rank reached
    would wait for the others until the process group's timeout."""
    results = []
    for use in (False, True):
        launched = spawn(_ddp_lengths_rank, 2, use, timeout_s=120)
        assert launched.ok, launched.exit_codes
        results.append(launched.results)
    for plain, swapped in zip(*results, strict=True):
        assert _equal(plain, swapped)


def _family(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A 3-block model of a family pipeswap's pipelines cannot cut yet, and its batch."""
    t = transformers
    small = {"vocab_size": VOCAB}
    configs: dict[str, tuple[Any, Any]] = {
        "bloom": (t.BloomForCausalLM, t.BloomConfig(hidden_size=32, n_layer=3, n_head=4, **small)),
        "gptj": (
            t.GPTJForCausalLM,
            t.GPTJConfig(n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_positions=64, **small),
        ),
        "t5": (
            t.T5ForConditionalGeneration,
            t.T5Config(
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=3,
                num_heads=4,
                decoder_start_token_id=0,
                pad_token_id=0,
                dropout_rate=0.1,
                **small,
            ),
        ),
        "bart": (
            t.BartForConditionalGeneration,
            t.BartConfig(
                d_model=32,
                encoder_layers=3,
                decoder_layers=3,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                dropout=0.1,
                **small,
            ),
        ),
        "phimoe": (
            t.PhimoeForCausalLM,
            t.PhimoeConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                max_position_embeddings=64,
                **small,
            ),
        ),
        "bert-classifier": (
            t.BertForSequenceClassification,
            t.BertConfig(
                hidden_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
                num_labels=3,
                **small,
            ),
        ),
    }
    cls, config = configs[name]
    torch.manual_seed(0)
    return cls(config), {}


@pytest.mark.parametrize("name", ["bloom", "gptj", "t5", "bart", "phimoe", "bert-classifier"])
def test_families_pipelines_cannot_cut_train_bit_identically_through_offload(name: str) -> None:
    """Tuple-returning blocks, encoder-decoders (dropout on: a shared encoder output), a
    mixture of experts whose routing changes what its blocks save from step to step, and a
    sequence classifier, each with its own labels."""
    data = batches()
    for batch in data:
        if name == "bert-classifier":
            batch["labels"] = batch["input_ids"][:, 0] % 3
        elif name in ("t5", "bart"):
            batch["labels"] = batch["input_ids"][:, :10].clone()
            # offload runs training forwards without a key/value cache (as transformers'
            # gradient checkpointing does): with one, T5's decoder differs in the last bit.
            batch["use_cache"] = False
    plain = train_loop(_family(name)[0], nullcontext, data)
    model = _family(name)[0]
    # Every saved activation of the blocks moves with save-on-cpu: the experts' too.
    moving = {"policy": "save-on-cpu"} if name == "phimoe" else {"footprint_ratio": 1.05}
    off = offload(model, **moving)
    assert _equal(plain, train_loop(model, lambda: off, data))
    stats = off.stats()
    assert stats["swapped_bytes"] > 0
    assert (stats["unmatched_tensors"] > 0) is (name == "phimoe")  # kept, not swapped wrongly


def test_inside_a_transformers_trainer_it_trains_bit_identically(tmp_path: Path) -> None:
    """The README's Trainer subclass: offload around Trainer's forward, the rest Trainer's."""
    pytest.importorskip("accelerate")
    datasets = pytest.importorskip("datasets")

    class OffloadTrainer(transformers.Trainer):
        def __init__(self, *args: Any, offload: dict[str, Any] | None = None, **kw: Any):
            super().__init__(*args, **kw)
            self.offload = None if offload is None else pipeswap_offload(self.model, **offload)

        def compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kw: Any) -> Any:
            with self.offload or nullcontext():
                return super().compute_loss(model, inputs, *args, **kw)

    ids = torch.randint(0, VOCAB, (40, SEQ), generator=torch.Generator().manual_seed(3))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    runs = []
    for settings in (None, {"footprint_ratio": 1.2, "policy": "bidirectional"}):
        args = transformers.TrainingArguments(
            str(tmp_path / "out"),
            per_device_train_batch_size=8,
            max_steps=5,
            logging_steps=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
        )
        trainer = OffloadTrainer(
            model=tiny("gpt2"), args=args, train_dataset=data, offload=settings
        )
        trainer.train()
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        runs.append((losses, [p.detach().clone() for p in trainer.model.parameters()]))
        if trainer.offload is not None:
            assert trainer.offload.stats()["swapped_bytes"] > 0
    assert len(runs[0][0]) == 5 and _equal(runs[0], runs[1])


def test_with_the_users_own_activation_checkpointing() -> None:
    """Non-reentrant checkpointing of every block: what still is saved moves, bit-identically."""

    def checkpointed() -> nn.Module:
        model = tiny("llama")
        settings = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=settings)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings)
        return model

    plain = train_loop(checkpointed(), nullcontext, batches())
    model = checkpointed()
    off = offload(model, policy="save-on-cpu")
    assert _equal(plain, train_loop(model, lambda: off, batches()))
    assert off.stats()["swapped_bytes"] > 0


def _refused_rank(rank: int, world: int) -> str:
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    model = DistributedDataParallel(tiny("gpt2"))
    off = offload(model, gpu_memory=1000)
    try:
        train_loop(model, lambda: off, batches())
    except ConfigError as exc:
        return str(exc)
    return "trained"


@pytest.mark.dist
def test_a_budget_rank_0_cannot_plan_for_stops_every_rank_saying_why() -> None:
    launched = spawn(_refused_rank, 2, timeout_s=60)
    assert launched.ok, launched.exit_codes
    assert all("pass gpu_memory" in said for said in launched.results)


class _Branching(nn.Module):
    """A block that takes a second branch every other call: it saves more tensors then."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 32)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.tanh(self.first(x))
        return torch.tanh(self.second(y)) if self.calls % 2 == 0 else y


class _BranchingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Branching() for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _branching_loop(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(8):
        with wrap():
            loss = model(torch.randn(16, 32, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_forward_that_saves_other_tensors_each_step_trains_as_without_offload() -> None:
    """Hostile input round 4, item 7: what the names do not fit stays on the device."""
    plain = _branching_loop(_BranchingNet(), nullcontext)
    model = _BranchingNet()
    off = offload(model, policy="save-on-cpu")
    assert _branching_loop(model, lambda: off) == plain
    stats = off.stats()
    assert stats["unmatched_tensors"] > 0 and stats["swapped_bytes"] > 0


def test_check_memory_on_the_cpu_reads_every_step_s_forward_and_backward() -> None:
    """stats()['step_peak_bytes'] is the storage count of the step that ran, the same as
    a meter of the test's own around its forward and backward, and within the budget."""
    pytest.importorskip("transformers")
    from pipeswap.profiling.meter import DeviceMeter
    from tests.training.test_loop_shapes import _llama, padded_batches

    model = _llama(layers=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = offload(model, footprint_ratio=1.4, optimizer=optimizer, check_memory=True)
    ours: list[int] = []
    theirs: list[int] = []
    for batch in padded_batches(1, 48, 48) + padded_batches(5, 24, 40):
        with DeviceMeter("cpu", holding=(model, optimizer, batch), exclude=off.host_pools()) as m:
            with off:
                loss = model(**batch).loss
            loss.backward()
            ours.append(off.stats()["step_peak_bytes"])
        theirs.append(m.peak)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # The second step plans (the test's meter counts its passes too); from the third the
    # first plan serves every step, the optimizer's state exists and both count it.
    for mine, real in zip(ours[2:], theirs[2:], strict=True):
        assert real * 0.98 <= mine <= real * 1.02, (ours, theirs)
    assert max(ours[1:]) <= off.stats()["budget_bytes"] * 1.02


class _Twice(nn.Module):
    """A block that applies one Linear twice (a tied projection, ProphetNet's streams):
    under autocast its weight is cast once and the cast's two gradients summed in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(128, 128)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.proj(torch.tanh(self.proj(h)))


class _TwiceApplied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 128)
        self.layers = nn.ModuleList(_Twice() for _ in range(3))
        self.head = nn.Linear(128, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> Any:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Output", (), {"loss": loss})()


@pytest.mark.parametrize("policy", ["disjoint", "recompute"])
def test_a_weight_used_twice_in_a_layer_trains_as_the_loop_under_autocast(policy: str) -> None:
    def bf16(cache: bool = True) -> AbstractContextManager[Any]:
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache)

    torch.manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (4, 4, 512))]
    plain = train_loop(_TwiceApplied(), nullcontext, data, cast=bf16)
    # Two casts of the weight (autocast without its cache) give other weights: the check
    # below can tell. pipeswap keeps the user's cache and lets go of it at layers' edges.
    uncached = train_loop(_TwiceApplied(), nullcontext, data, cast=lambda: bf16(False))
    assert not _equal(plain, uncached)
    model = _TwiceApplied()
    # (Recomputing these small blocks frees less than their re-run holds: "recompute"
    # plans every block at the budget its refusal of a ratio names.)
    budget = {"footprint_ratio": 1.25} if policy == "disjoint" else {"gpu_memory": 2**23}
    off = offload(model, policy=policy, **budget)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each layer runs once a forward: nothing to warn of
        assert _equal(plain, train_loop(model, lambda: off, data, cast=bf16))
    stats = off.stats()
    assert stats["swapped_bytes"] > 0 if policy == "disjoint" else stats["recomputed_layers"] > 0
    off.close()


class _Repeated(_TwiceApplied):
    """Each block called twice a forward (a recurrent depth, Dory's or HRM's)."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **_: Any) -> Any:
        h = self.embed(input_ids)
        for _ in range(2):
            for layer in self.layers:
                h = layer(h)
        logits = self.head(h).float()
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Output", (), {"loss": loss})()


def test_a_layer_called_twice_a_forward_under_autocast_is_warned_of() -> None:
    torch.manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (3, 4, 512))]
    model = _Repeated()
    off = offload(model, policy="disjoint", footprint_ratio=1.25)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with pytest.warns(UserWarning, match="runs more than once in a forward: under autocast"):
        train_loop(model, lambda: off, data, cast=bf16)
    assert off.stats()["unmatched_tensors"] > 0  # the second calls' tensors stay put
    off.close()
