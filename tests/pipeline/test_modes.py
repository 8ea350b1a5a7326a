"""The weight-mode table: one entry is all a mode needs, and every entry works everywhere.

A copy of ``stale`` under a new name, registered for one test, goes through every place
that must know a mode (the config and its optimizer check, the partitioner's memory
model, StageWeights, the emulator, delayed.schedule_delays) and behaves exactly as
``stale``; then every entry of the table goes through the same places.

Covers: pipeswap/schedule/modes.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from support import pipeline_run, toy_layer, toy_profile_of
from torch import nn

from pipeswap.config_fields import ConfigError, replace_fields
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.delayed import schedule_delays
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.weights import StageWeights
from pipeswap.profiling.profile import Profile
from pipeswap.schedule.kinds import SCHEDULES
from pipeswap.schedule.modes import (
    ADAM_FAMILY,
    ANY_OPTIMIZER,
    MOMENTUM,
    SGD_MOMENTUM,
    WEIGHT_MODES,
    WeightMode,
    weight_mode,
)
from pipeswap.schedule.partition import extra_weight_copies, stage_memory_bytes
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.train_config import TrainConfig

TWIN = "stale-twin"
# A 2-stage async-1f1b run of gpt2-micro (its tied embedding is held by both stages).
GPT = pipeline_run(
    "gpt2-micro", (2, 2), schedule="async-1f1b", batch=4, seq_len=16, steps=4, lr=0.05
)
# The same model untied, for the per-layer delays (a tied one has none on async schedules).
UNTIED = replace_fields(GPT, model="pipeline_toys:gpt2_micro_untied")
# An optimizer each family fits, and one it does not.
FITS = {
    ANY_OPTIMIZER: OptimizerConfig(optimizer="sgd", lr=0.05),
    SGD_MOMENTUM: OptimizerConfig(optimizer="sgd", lr=0.05, momentum=0.9),
    ADAM_FAMILY: OptimizerConfig(optimizer="adamw", lr=3e-3),
    MOMENTUM: OptimizerConfig(optimizer="sgd", lr=0.05, momentum=0.9),
}
MISFITS = {
    SGD_MOMENTUM: OptimizerConfig(optimizer="sgd", momentum=0.0),
    ADAM_FAMILY: OptimizerConfig(optimizer="sgd"),
    MOMENTUM: OptimizerConfig(optimizer="sgd", momentum=0.0),
}


@pytest.fixture
def twin() -> Iterator[WeightMode]:
    """``stale`` under another name, in the table for the test only."""
    mode = dataclasses.replace(WEIGHT_MODES["stale"], name=TWIN)
    WEIGHT_MODES[TWIN] = mode
    try:
        yield mode
    finally:
        del WEIGHT_MODES[TWIN]


def _profile() -> Profile:
    layers = (
        toy_layer(f"l{i}", 1.0, 2.0, param_bytes=1000, output_bytes=10, saved=[400])
        for i in range(4)
    )
    return toy_profile_of(layers, batch=8, device="cpu", optimizer_state_bytes=4000)


def _memory(weights: str) -> list[int]:
    """Stage memory of every stage under every schedule (micro-batches 1 and 4)."""
    out = []
    for name, kind in SCHEDULES.items():
        for micro in (1, 4) if kind.takes_micro_batches else (1,):
            out += [
                stage_memory_bytes(
                    _profile(), k, k + 1, k, 4, schedule=name, micro_batches=micro, weights=weights
                )
                for k in range(4)
            ]
    return out


def _one_weight(mode: str, optimizer: OptimizerConfig) -> dict[str, float]:
    """A one-weight stage run as stage 0 of two on async-1f1b (forwards one update ahead):
    the weight each pass saw, and the live weight after each update (``U0``...)."""
    module = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        module.weight.fill_(0.5)
    distances = {("F", 0): 0, ("F", 1): 1, ("F", 2): 1} | {("B", u): 0 for u in range(3)}
    weights = StageWeights(module, mode, distances, {u: u for u in range(3)}, optimizer)  # type: ignore[arg-type]
    w = weights.params[0]
    seen, live = {}, w.item()
    for action in ("F0", "F1", "B0", "U0", "F2", "B1", "U1", "B2", "U2"):
        kind, unit = action[0], int(action[1])
        if kind == "U":
            w.grad = torch.full_like(w, 0.25 * (unit + 1))
            weights.update(unit)
            live = w.item()
        else:
            weights.before(kind, unit)  # type: ignore[arg-type]
            seen[action] = w.item()
            weights.after(kind, unit)  # type: ignore[arg-type]
            assert w.item() == live  # the live weights come back after every pass
        seen[action] = seen.get(action, live)
    return seen


def _delays(config: TrainConfig) -> tuple[int, ...] | str:
    """schedule_delays, or the message of the ConfigError it raises."""
    try:
        return schedule_delays(config)
    except ConfigError as error:
        return error.message


def test_a_copy_of_stale_is_one_entry_and_runs_everywhere_as_stale(twin: WeightMode) -> None:
    # The config takes it, with any optimizer.
    pipe = PipelineConfig(stages=2, schedule="async-1f1b", weights=TWIN)
    for optimizer in (OptimizerConfig(optimizer="sgd"), OptimizerConfig(optimizer="adam")):
        TrainConfig("gpt2-micro", optim=optimizer, pipeline=pipe)
    # The partitioner's memory model.
    assert _memory(TWIN) == _memory("stale")
    for name in SCHEDULES:
        assert extra_weight_copies(TWIN, 5, name) == extra_weight_copies("stale", 5, name) == 0
    # A stage's weights.
    sgd = OptimizerConfig(optimizer="sgd", lr=0.1, momentum=0.9)
    assert _one_weight(TWIN, sgd) == _one_weight("stale", sgd)
    # The emulator, bit for bit.
    twin_run = Emulator(replace_fields(GPT, weights=TWIN)).run()
    stale_run = Emulator(replace_fields(GPT, weights="stale")).run()
    assert twin_run.losses == stale_run.losses
    assert twin_run.params_sha256 == stale_run.params_sha256
    assert twin_run.prediction_error == stale_run.prediction_error
    assert twin_run.to_report()["config"]["weights"] == TWIN
    # The per-layer delays: none on a synchronous schedule, and the same refusal on an
    # asynchronous one (stale mixes two versions), naming the mode.
    for changes in ({"schedule": "1f1b", "micro_batches": 2}, {}):
        stale = _delays(replace_fields(UNTIED, weights="stale", **changes))
        assert _delays(replace_fields(UNTIED, weights=TWIN, **changes)) == (
            stale if isinstance(stale, tuple) else stale.replace("stale", TWIN)
        )
    assert "no single delay" in str(_delays(replace_fields(UNTIED, weights=TWIN)))
    assert _delays(replace_fields(UNTIED, weights=TWIN, schedule="gpipe")) == (0, 0, 0, 0)


def test_the_twin_leaves_with_its_fixture() -> None:
    assert TWIN not in WEIGHT_MODES
    with pytest.raises(ConfigError, match=f"unknown weights '{TWIN}'; valid: stale, stash"):
        PipelineConfig(stages=2, weights=TWIN)


@pytest.mark.parametrize("name", list(WEIGHT_MODES))
def test_every_entry_runs_through_every_place(name: str) -> None:
    mode = weight_mode(name)
    assert mode.name == name and mode.optimizer in (
        ANY_OPTIMIZER,
        SGD_MOMENTUM,
        ADAM_FAMILY,
        MOMENTUM,
    )
    optimizer = FITS[mode.optimizer]
    # The config, and its check against the optimizer.
    pipe = PipelineConfig(stages=2, schedule="async-1f1b", weights=name)
    TrainConfig("gpt2-micro", optim=optimizer, pipeline=pipe)
    if mode.optimizer in MISFITS:
        with pytest.raises(ConfigError, match=f"weights {name} "):
            TrainConfig("gpt2-micro", optim=MISFITS[mode.optimizer], pipeline=pipe)
    # The memory model: a stash per in-flight unit (one on 2bw), or one backup.
    for kind in SCHEDULES.values():
        copies = mode.extra_weight_copies(8, kind)
        if mode.stashes:
            assert copies == (8 if kind.stash_versions is None else kind.stash_versions)
        else:
            assert copies == int(mode.predicts)
    # A stage's weights: the first passes see the initial weights in every mode; after an
    # update, a forward one update ahead sees other weights than the live ones when the
    # mode predicts, and the backward of a unit whose forward came before the update when
    # it stashes (it sees the forward's).
    seen = _one_weight(name, optimizer)
    assert seen["F0"] == seen["F1"] == seen["B0"] == 0.5 != seen["U0"]
    assert (seen["F2"] != seen["U0"]) == mode.predicts
    assert (seen["B1"] != seen["U0"]) == mode.stashes
    assert seen["B1"] == (seen["F1"] if mode.stashes else seen["U0"])
    # The emulator, two stages of gpt2-micro on async-1f1b.
    config = replace_fields(GPT, weights=name, **dataclasses.asdict(optimizer))
    result = Emulator(config).run()
    assert all(torch.isfinite(torch.tensor(result.losses)))
    first = Emulator(replace_fields(GPT, steps=1)).run().losses[0]
    assert result.losses[0] == first  # the first mini-batch meets fresh weights in every mode
    # The per-layer delays: a synchronous schedule has none, and on async-1f1b only a mode
    # that takes each gradient at one version (it stashes) is a delay.
    untied = replace_fields(UNTIED, weights=name, **dataclasses.asdict(optimizer))
    if mode.live:
        assert _delays(replace_fields(untied, schedule="1f1b", micro_batches=2)) == (0, 0, 0, 0)
    else:  # nothing is stale on a synchronous schedule: a mode that changes versions is refused
        with pytest.raises(ConfigError, match=f"weights {name} chooses .* is synchronous"):
            replace_fields(untied, schedule="1f1b", micro_batches=2)
    delays = _delays(untied)
    if mode.stashes:
        assert delays == (1, 1, 0, 0)
    else:
        assert isinstance(delays, str) and f"{{weights}} {name} " in delays


def test_unknown_modes_name_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="valid: stale, stash, spectrain, predict-adam, nesterov"):
        weight_mode("guess")


def test_refusals_name_the_optimizers_values() -> None:
    with pytest.raises(ConfigError) as info:
        weight_mode("spectrain").check_optimizer(OptimizerConfig(optimizer="sgd", momentum=0.0))
    assert info.value.message.startswith(
        "{weights} spectrain predicts with the SGD momentum buffer, but {optimizer} sgd "
        "{momentum} 0.0 has none"
    )
    weight_mode("nesterov").check_optimizer(OptimizerConfig(optimizer="sgd"))
    with pytest.raises(ConfigError, match="Nesterov momentum .* sgd momentum 0.0 has none"):
        weight_mode("nesterov").check_optimizer(OptimizerConfig(optimizer="sgd", momentum=0.0))
    weight_mode("stale").check_optimizer(OptimizerConfig(optimizer="adam"))
