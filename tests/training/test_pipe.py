"""pipeswap.Pipeline in your own loop trains as `pipeswap train --pipeline` does, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from support import pipeline_run

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.dist.digest import params_sha256
from pipeswap.dist.launch import spawn
from pipeswap.dist.peers import lost_peers
from pipeswap.errors import PipeswapError
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.feed import FedBatches
from pipeswap.pipeline.job import BatchSource, build_full_model
from pipeswap.train_config import TrainConfig
from pipeswap.training.pipe import Pipeline

BASE = pipeline_run("gpt2-micro", (2, 2), batch=8, seq_len=16, steps=4, micro_batches=4)


def _pipe(config: TrainConfig, **extra: Any) -> Pipeline:
    pipeline = config.require_pipeline()
    settings: dict[str, Any] = {
        "stages": pipeline.num_stages,
        "steps": config.steps,
        "schedule": pipeline.schedule,
        "micro_batches": pipeline.micro_batches,
        "weights": pipeline.weights,
        "optimizer": config.optim,
        "balance": pipeline.balance,
        "seed": config.seed,
    }
    # The seeded weights `pipeswap train` starts from.
    return Pipeline(build_full_model(config), **{**settings, **extra})


def _train(rank: int, world: int, config: TrainConfig) -> dict[str, Any]:
    """The user's loop: pipe.step over the batches the CLI run would read."""
    pipe = _pipe(config)
    data = BatchSource(config, build_full_model(config))
    losses = [pipe.step(*data.batch(t)) for t in range(config.steps)]
    held_out = pipe.eval(*data.batch(config.steps))
    state = pipe.state_dict()
    pipe.close()
    digest = params_sha256(pipe.layered) if rank == 0 else None
    return {"losses": losses, "eval": held_out, "state": state, "digest": digest}


CASES = [
    BASE,
    replace_fields(BASE, schedule="gpipe", clip_grad_norm=0.05),
    replace_fields(
        BASE, schedule="async-1f1b", weights="spectrain", micro_batches=1, batch=4, steps=6
    ),
    replace_fields(BASE, schedule="2bw", weights="stash", micro_batches=2, batch=4, steps=5),
]


@pytest.mark.dist
@pytest.mark.parametrize(
    "config", CASES, ids=["1f1b", "gpipe-clip", "async-spectrain", "2bw-stash"]
)
def test_a_loop_of_pipe_steps_is_the_emulated_run_bit_for_bit(config: TrainConfig) -> None:
    launched = spawn(_train, 2, config, timeout_s=120)
    assert launched.ok, launched.exit_codes
    first, last = launched.results
    emulated = Emulator(config).run()
    assert tuple(last["losses"]) == emulated.losses
    assert first["losses"] == [None] * config.steps  # the last stage knows the losses
    assert first["digest"] == emulated.params_sha256
    assert last["state"] is None and isinstance(last["eval"], float) and first["eval"] is None
    # Rank 0's model now holds every stage's trained weights, by the model's own names.
    assert set(first["state"]) == set(build_full_model(config).state_dict())


def _train_without_steps(rank: int, world: int, config: TrainConfig) -> dict[str, Any]:
    """The user's loop, with no steps= given: the schedule is built 2 steps ahead and
    lengthened as the calls come (several times here), then drained at state_dict."""
    from pipeswap.pipeline import horizon

    horizon.FIRST_HORIZON = 2
    pipe = _pipe(config, steps=None)
    data = BatchSource(config, build_full_model(config))
    losses = [pipe.step(*data.batch(t)) for t in range(config.steps)]
    state = pipe.state_dict()
    held_out = pipe.eval(*data.batch(config.steps))
    with pytest.raises(ConfigError, match="ended the training of this pipeline"):
        pipe.step(*data.batch(0))
    pipe.close()
    digest = params_sha256(pipe.layered) if rank == 0 else None
    return {"losses": losses, "eval": held_out, "state": state, "digest": digest}


@pytest.mark.dist
@pytest.mark.parametrize(
    "config",
    [  # the synchronous and 2BW cases take make test-slow (make test's time)
        pytest.param(CASES[0], id="1f1b", marks=pytest.mark.slow),
        pytest.param(CASES[2], id="async-spectrain"),
        pytest.param(CASES[3], id="2bw-stash", marks=pytest.mark.slow),
    ],
)
def test_a_pipeline_without_steps_drains_at_state_dict_as_one_built_for_them(
    config: TrainConfig,
) -> None:
    """Bit for bit the run of a pipeline told the steps in advance (tied weights across
    the stages, weight prediction, 2BW's stash), the same held-out loss after it."""
    unknown = spawn(_train_without_steps, 2, config, timeout_s=120)
    known = spawn(_train, 2, config, timeout_s=120)
    assert unknown.ok and known.ok, (unknown.exit_codes, known.exit_codes)
    for mine, theirs in zip(unknown.results, known.results):
        assert mine["losses"] == theirs["losses"]
        assert mine["digest"] == theirs["digest"] and mine["eval"] == theirs["eval"]
    assert unknown.results[0]["digest"] == Emulator(config).run().params_sha256


def _ragged(config: TrainConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches as a padding collator makes them: each its own length, and a short one."""
    data = BatchSource(config, build_full_model(config))
    lengths = [16, 11, 16, 9, 13, 16]
    out = []
    for t in range(config.steps):
        x, y = data.batch(t)
        rows = len(x) // 2 if t == 2 else len(x)  # a short batch (micro-batches halve)
        out.append((x[:rows, : lengths[t]], y[:rows, : lengths[t]]))
    return out


def _train_ragged(rank: int, world: int, config: TrainConfig) -> dict[str, Any]:
    pipe = _pipe(config, steps=None)
    batches = _ragged(config)
    losses = [pipe.step(x, y) for x, y in batches]
    held_out = [pipe.eval(*batches[1]), pipe.eval(*batches[0])]
    pipe.state_dict()
    pipe.close()
    digest = params_sha256(pipe.layered) if rank == 0 else None
    return {"losses": losses, "eval": held_out, "digest": digest}


@pytest.mark.dist
@pytest.mark.parametrize("config", [CASES[0], CASES[2]], ids=["1f1b", "async-spectrain"])
def test_batches_of_every_length_train_as_the_emulator_does(config: TrainConfig) -> None:
    """Each stage receives each batch's own shape (traced once per shape, without
    compute): the losses and weights of the emulator fed the same batches, bit for bit."""
    launched = spawn(_train_ragged, 2, config, timeout_s=120)
    assert launched.ok, launched.exit_codes
    first, last = launched.results
    fed = FedBatches(micro_batches=config.require_pipeline().micro_batch_count)
    fed.batches = dict(enumerate(_ragged(config)))
    emulated = Emulator(replace_fields(config, eval_batches=0), data=fed).run()
    assert tuple(last["losses"]) == emulated.losses
    assert first["digest"] == emulated.params_sha256
    assert all(isinstance(loss, float) for loss in last["eval"])


def test_a_pipeline_of_one_stage_is_plain_training() -> None:
    config = replace_fields(BASE, balance=(4,), steps=3)
    pipe = _pipe(config)
    data = BatchSource(config, build_full_model(config))
    losses = [pipe.step(*data.batch(t)) for t in range(config.steps)]
    reference = build_full_model(config)
    optimizer = config.optim.build(reference.parameters())
    expected = []
    for t in range(config.steps):
        x, y = data.batch(t)
        total = 0.0
        for m in range(4):
            part = slice(2 * m, 2 * m + 2)
            loss = reference.loss(reference(x[part]), y[part])
            (loss / 4).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total / 4)
    assert losses == pytest.approx(expected, rel=1e-5)
    state = pipe.state_dict()
    assert state is not None
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=1e-6)


def test_wrong_use_is_refused_saying_what_to_do() -> None:
    config = replace_fields(BASE, balance=(4,), steps=1)
    data = BatchSource(config, build_full_model(config))
    x, y = data.batch(0)
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node 2"):
        _pipe(replace_fields(config, balance=(2, 2)))
    with pytest.raises(ConfigError, match="timeout_s is nan: give seconds"):
        Pipeline(build_full_model(config), stages=1, timeout_s=float("nan"))
    pipe = _pipe(config)
    with pytest.raises(PipeswapError, match="target or its labels"):
        pipe.step(x)
    with pytest.raises(ConfigError, match="does not split into 4 micro_batches"):
        pipe.step(x[:6], y[:6])
    pipe.step(x, y)
    with pytest.raises(ConfigError, match="built for steps=1"):
        pipe.step(x, y)
    again = _pipe(replace_fields(config, steps=2))
    again.step(x, y)
    with pytest.raises(ConfigError, match="does not split into 4 micro_batches"):
        again.step(x[:2], y[:2])
    assert isinstance(again.step(x[:4, :9], y[:4, :9]), float)  # a short batch, shorter rows
    with pytest.raises(ConfigError, match="not RMSprop"):
        _pipe(
            replace_fields(config, schedule="async-1f1b", weights="spectrain", micro_batches=1),
            optimizer=lambda ps: torch.optim.RMSprop(ps),
        ).step(x, y)
    with pytest.raises(ConfigError, match="accumulate"):
        _pipe(config, optimizer=OptimizerConfig(accumulate=2))


def _train_in_two_runs(
    rank: int, world: int, config: TrainConfig, folder: str, ragged: bool = False
) -> dict[str, Any]:
    """Half the steps, pipe.save; a new pipeline pipe.load-s and trains the rest."""
    data = BatchSource(config, build_full_model(config))
    batches = _ragged(config) if ragged else [data.batch(t) for t in range(config.steps)]
    half = config.steps // 2
    pipe = _pipe(config)
    losses = [pipe.step(*batches[t]) for t in range(half)]
    pipe.save(folder)
    pipe.close()
    again = _pipe(config)
    done = again.load(folder)
    losses += [again.step(*batches[t]) for t in range(done, config.steps)]
    again.state_dict()
    again.close()
    return {"losses": losses, "done": done, "digest": params_sha256(again.layered)}


@pytest.mark.dist
def test_a_saved_pipeline_continues_as_if_left_alone(tmp_path: Any) -> None:
    """pipe.save / pipe.load (pipeswap.training.pipe_checkpoint, pipeswap.pipeline.stage_restore): tied weights across the
    stages, SGD momentum and the step count carry over, bit for bit."""
    config = replace_fields(BASE, optimizer="adamw", lr=0.003)
    launched = spawn(_train_in_two_runs, 2, config, str(tmp_path), timeout_s=120)
    assert launched.ok, launched.exit_codes
    first, last = launched.results
    emulated = Emulator(config).run()
    assert first["done"] == 2 and tuple(last["losses"]) == emulated.losses
    assert first["digest"] == emulated.params_sha256
    with pytest.raises(ConfigError, match="asynchronous schedule"):
        async_run = replace_fields(BASE, schedule="async-1f1b", micro_batches=1, balance=(4,))
        _pipe(async_run).load(tmp_path)


@pytest.mark.dist
def test_a_pipeline_of_batches_of_every_length_continues_from_its_checkpoint(
    tmp_path: Any,
) -> None:
    """The first batch's shape is no setting of the run's: a checkpoint goes on with a
    batch of another length (it was refused: "written with seq_len = 16, but this run has
    9"), as the run left alone would have."""
    config = CASES[0]
    launched = spawn(_train_in_two_runs, 2, config, str(tmp_path), True, timeout_s=120)
    assert launched.ok, launched.exit_codes
    first, last = launched.results
    fed = FedBatches(micro_batches=config.require_pipeline().micro_batch_count)
    fed.batches = dict(enumerate(_ragged(config)))
    emulated = Emulator(replace_fields(config, eval_batches=0), data=fed).run()
    assert tuple(last["losses"]) == emulated.losses
    assert first["digest"] == emulated.params_sha256


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_labels_score_with_the_model_s_own_loss(family: str) -> None:
    """labels= goes to the model's forward: GPT-2 shifts them, BERT's masked LM does not."""
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    config = hf_config(family)
    cls = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.BertForMaskedLM
    torch.manual_seed(0)
    model = cls(config)
    plain = copy.deepcopy(model)
    pipe = Pipeline(
        model,
        stages=1,
        steps=2,
        micro_batches=2,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    ids = torch.randint(5, 200, (2, 4, 12))
    for batch in ids:
        loss = pipe.step(batch, labels=batch)
        expected = 0.0
        for part in batch.chunk(2):
            own = plain(input_ids=part, labels=part).loss
            (own / 2).backward()
            expected += own.item() / 2
        optimizer.step()
        optimizer.zero_grad()
        assert loss == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ConfigError, match="keep to it"):
        pipe.eval(ids[0], target=ids[0])


def _catching(rank: int, world: int, config: TrainConfig) -> tuple[str, list[str]] | None:
    """A loop that catches its step's error, as a script that logs and goes on does: the
    second step's target names a class the last stage cannot score (its loss fails), so
    only the last stage fails; the first waits for that stage's gradients."""
    pipe = _pipe(config)
    data = BatchSource(config, build_full_model(config))
    x, y = data.batch(0)
    pipe.step(x, y)
    bad = y.clone()
    bad[0, 0] = 10**6
    try:
        pipe.step(x, bad)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", getattr(exc, "__notes__", [])
    finally:
        pipe.close()
    return None


@pytest.mark.dist
def test_a_step_that_fails_on_one_stage_stops_the_others_at_once() -> None:
    """The failing stage closes its process group (pipeswap.dist.group.failing_together):
    the stage waiting for its gradients fails at once as a lost peer, even though both
    scripts catch the error, instead of waiting out the group's timeout (120 s here)."""
    launched = spawn(_catching, 2, replace_fields(BASE, steps=2), timeout_s=120)
    assert launched.ok, launched.exit_codes
    assert launched.elapsed_s < 40, launched.elapsed_s
    (first, first_notes), (last, last_notes) = launched.results
    assert "out of bounds" in last, last
    assert last_notes == [
        "pipeswap: rank 1 closed its process group so that the other ranks stop at once (they report a lost peer)"
    ]
    assert lost_peers(RuntimeError(first)), first
    assert first_notes and "rank 0 closed" in first_notes[0]


def _rwkv() -> Any:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    config = hf_config("rwkv")
    torch.manual_seed(0)
    return transformers.RwkvForCausalLM(config)


_RWKV_BATCHES = torch.randint(0, 64, (2, 4, 12), generator=torch.Generator().manual_seed(1))


def _train_rwkv(rank: int, world: int) -> list[float | None]:
    pipe = Pipeline(
        _rwkv(),
        stages=2,
        steps=2,
        schedule="gpipe",
        micro_batches=2,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    losses = [pipe.step(ids, labels=ids) for ids in _RWKV_BATCHES]
    pipe.close()
    return losses


@pytest.mark.dist
def test_a_model_that_rescales_its_weights_in_eval_mode_trains_as_its_plain_loop() -> None:
    """Hugging Face's RWKV writes its weights in place when its mode changes: the shape
    probe's eval forward must leave them (and its flag) as they were, or the last stage's
    next training forward writes them after its blocks saved them (pipeswap.models.written)."""
    model = _rwkv()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = []
    for ids in _RWKV_BATCHES:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        plain.append(loss.item())
    launched = spawn(_train_rwkv, 2, timeout_s=120)
    assert launched.ok, launched.exit_codes
    assert launched.results[1] == pytest.approx(plain, rel=1e-5)
