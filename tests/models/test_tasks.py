"""The task table: a new task is one entry, and every place that depends on a task asks it.

A copy of each entry under a new name, registered for one test, goes through every place
that used to compare task names (the loss and example batches of a LayeredModel, a
model spec's size checks and defaults, the built-in data, the profilers, the run's
config and its default optimizer, held-out scoring, the pipeline emulator) and behaves
exactly as the entry it copies. A task in no entry is refused naming the known ones.

Covers: pipeswap/models/tasks.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from support import pipeline_run

from pipeswap.config_fields import ConfigError
from pipeswap.data import dataset_for
from pipeswap.models.base import LayeredModel
from pipeswap.models.registry import build_model, model_spec, shape_defaults
from pipeswap.models.tasks import IMAGE_SIZE, SEQ_LEN, TASKS, Task, scores_accuracy, task_kind
from pipeswap.pipeline.emulator import Emulator
from pipeswap.profiling.estimate import estimate
from pipeswap.profiling.measure import measure
from pipeswap.train_config import TrainConfig

TWIN = "twin-task"
# A zoo model of each task, and its input size.
ZOO = {"lm": ("gpt2-micro", {"seq_len": 16}), "classify": ("resnet-micro", {"image_size": 32})}
# The same zoo models as a user's ``module:function`` (their spec is read off the model).
USER = {name: f"tests.models.test_tasks:{name}_model" for name in ZOO}


def _user(task: str) -> LayeredModel:
    zoo, _ = ZOO[task]
    return build_model(zoo, tie_embeddings=None if task != "lm" else True)


def lm_model() -> LayeredModel:
    return _user("lm")


def classify_model() -> LayeredModel:
    return _user("classify")


def twin_lm_model() -> LayeredModel:
    model = _user("lm")
    model.task = TWIN
    return model


def twin_classify_model() -> LayeredModel:
    model = _user("classify")
    model.task = TWIN
    return model


@pytest.fixture(params=list(TASKS))
def twin(request: pytest.FixtureRequest) -> Iterator[Task]:
    """An entry, with its copy in the table under another name for the test only."""
    task = TASKS[request.param]
    TASKS[TWIN] = dataclasses.replace(task, name=TWIN)
    try:
        yield task
    finally:
        del TASKS[TWIN]


def _outcome(call: object, *args: object, **kwargs: object) -> object:
    """What ``call`` returns, or the message of the ConfigError it raises."""
    try:
        return call(*args, **kwargs)  # type: ignore[operator]
    except ConfigError as error:
        return error.message


def _resolved(model: str, **fields: object) -> TrainConfig:
    return TrainConfig(model, **fields).resolved()  # type: ignore[arg-type]


def _same(call: object, name: str, name_ref: str, *args: object, **kwargs: object) -> bool:
    """``call`` on the twin's model and on its entry's give the same, or the same refusal."""
    mine, theirs = _outcome(call, name, *args, **kwargs), _outcome(call, name_ref, *args, **kwargs)
    if isinstance(theirs, str):
        return isinstance(mine, str) and mine.replace(name, name_ref) == theirs
    return mine == theirs


def test_a_copy_of_an_entry_is_one_entry_and_runs_everywhere_as_it(twin: Task) -> None:
    zoo, sizes = ZOO[twin.name]
    reference = build_model(zoo)
    model = build_model(zoo)
    model.task = TWIN
    assert model.task_entry == dataclasses.replace(twin, name=TWIN)
    # The model: what it takes, its example batches and its loss.
    assert model.takes_tokens == reference.takes_tokens
    x, y = model.example_batch(2, **sizes)
    x_ref, y_ref = reference.example_batch(2, **sizes)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    assert torch.equal(model.loss(model(x), y), reference.loss(reference(x), y))
    # Held-out scores count accuracy as the entry says.
    assert scores_accuracy(model) == scores_accuracy(reference) == twin.accuracy
    # The built-in data, and the refusal of the size that does not apply.
    data, data_ref = dataset_for(model, **sizes), dataset_for(reference, **sizes)
    assert type(data) is type(data_ref)
    assert all(torch.equal(a, b) for a, b in zip(data.batch(2, 0), data_ref.batch(2, 0)))
    other = {IMAGE_SIZE: 32} if twin.size == SEQ_LEN else {SEQ_LEN: 16}
    refused = _outcome(dataset_for, model, **other)
    assert refused == _outcome(dataset_for, reference, **other) and isinstance(refused, str)
    # The profilers record the size that applies.
    measured = measure(model, 2, **sizes, **other, repeats=1, warmup=0)
    estimated = estimate(build_model(zoo, device="meta"), 2, **sizes, **other)
    for profile in (measured, estimated):
        assert (profile.seq_len is not None) == twin.has_seq_len
        assert (profile.image_size is not None) == twin.has_image_size
    # A user's model of the task: its spec, its shape defaults and the run's config.
    name, name_ref = USER[twin.name].replace(":", ":twin_"), USER[twin.name]
    spec, spec_ref = model_spec(name), model_spec(name_ref)
    assert spec.task == TWIN and spec.task_entry.size == spec_ref.task_entry.size
    assert (spec.default_seq_len, spec.default_image_size) == (
        spec_ref.default_seq_len,
        spec_ref.default_image_size,
    )
    for seq_len, image_size in ((None, None), (sizes.get(SEQ_LEN), sizes.get(IMAGE_SIZE))):
        assert _same(shape_defaults, name, name_ref, seq_len, image_size)
    assert isinstance(_outcome(_resolved, name_ref, **sizes, **other), str)  # both sizes: refused
    assert _same(_resolved, name, name_ref, **sizes, **other)
    # A run that names no optimizer trains with the entry's recipe.
    optim = TrainConfig(name, **sizes).resolved().optim
    assert optim == TrainConfig(name_ref, **sizes).resolved().optim
    assert (optim.optimizer, optim.lr) == (twin.recipe.optimizer, twin.recipe.lr)


def test_a_copy_of_the_language_model_task_pipelines_as_it() -> None:
    TASKS[TWIN] = dataclasses.replace(TASKS["lm"], name=TWIN)
    try:
        runs = [
            Emulator(pipeline_run(name, (2, 2), batch=4, seq_len=16, steps=2, eval_batches=1)).run()
            for name in (USER["lm"].replace(":", ":twin_"), USER["lm"])
        ]
    finally:
        del TASKS[TWIN]
    mine, theirs = runs
    assert mine.losses == theirs.losses and mine.params_sha256 == theirs.params_sha256
    assert mine.to_report()["eval"] == theirs.to_report()["eval"]


@pytest.mark.parametrize("name", list(TASKS))
def test_every_entry_sizes_scores_and_refuses_as_it_says(name: str) -> None:
    task = task_kind(name)
    assert task.name == name and task.size in (SEQ_LEN, IMAGE_SIZE)
    assert task.has_seq_len != task.has_image_size
    zoo, sizes = ZOO[name]
    model = build_model(zoo)
    assert model.task_entry is task and model_spec(zoo).task_entry is task
    x, y = model.example_batch(2, **sizes)
    out = model(x)
    assert out.dim() == (3 if task.per_position else 2) and model.loss(out, y).isfinite()
    assert (x.dtype == torch.long) == task.takes_tokens
    other = IMAGE_SIZE if task.has_seq_len else SEQ_LEN
    with pytest.raises(ConfigError) as info:
        task.check_sizes(zoo, **{other: 8, task.size: None})  # type: ignore[arg-type]
    assert info.value.message == f"{zoo} is {task.noun}: pass {{{task.size}}}, not {{{other}}}"
    task.check_sizes(zoo, **{task.size: 8, other: None})  # type: ignore[arg-type]


def test_unknown_tasks_name_the_known_ones() -> None:
    assert TWIN not in TASKS
    with pytest.raises(ConfigError, match=f"unknown task '{TWIN}'; known: lm, classify"):
        task_kind(TWIN)
    with pytest.raises(ValueError, match="task must be one of lm, classify"):
        LayeredModel("toy", [("fc", torch.nn.Linear(2, 2))], TWIN)
    model = build_model("gpt2-micro")
    model.task = TWIN
    with pytest.raises(ConfigError, match=f"unknown task '{TWIN}'"):
        model.loss(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long))
    assert scores_accuracy(torch.nn.Linear(2, 2)) is False  # a module with no task
