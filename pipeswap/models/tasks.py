"""The model tasks as a table: what a model's output means, and everything that follows from it.

A model's ``task`` is a name (``"lm"``, ``"classify"``: what JSON, reports and the CLI
show); every place that depends on it asks the name's entry (:func:`task_kind`) instead of
comparing names: the loss (:meth:`pipeswap.models.base.LayeredModel.loss`), the example
batches, the input size that applies (``seq_len`` or ``image_size``, and the refusal of the
other), the built-in data, whether held-out scores count accuracy. A new task is one more
entry, as torchtitan's ``ModelSpec`` gathers one family's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.config_fields import ConfigError

__all__ = ["IMAGE_SIZE", "SEQ_LEN", "TASKS", "Recipe", "Task", "scores_accuracy", "task_kind"]

# The settings that size a model's input: the sequence length or the image side.
SEQ_LEN = "seq_len"
IMAGE_SIZE = "image_size"


@dataclass(frozen=True)
class Recipe:
    """What a run trains with when it does not name {optimizer}: the optimizer, its rate,
    the warm-up (a fraction of the run's steps) and the schedule after it."""

    optimizer: str
    lr: float
    warmup_fraction: float
    schedule: str

    def warmup(self, steps: int) -> int:
        return int(steps * self.warmup_fraction)

    def describe(self) -> str:
        """The recipe as the CLI's help states it (its help formatter reads ``%%`` as a percent sign)."""
        text = f"{self.optimizer} at {self.lr:g}"
        if self.warmup_fraction:
            text += f", warmed up over the first {self.warmup_fraction * 100:.0f}%% of the steps"
        if self.schedule != "constant":
            text += f", {self.schedule} decay to 0"
        return text


@dataclass(frozen=True)
class Task:
    """One task: what the model takes, what it outputs, how it is scored.

    ``noun`` names a model of the task in messages (``a language model``). ``size``: the
    setting that sizes its input, :data:`SEQ_LEN` (token sequences) or :data:`IMAGE_SIZE`
    (square images); the other setting is refused. ``takes_tokens``: its input is token
    ids (an embedding's; a model adapted from another task may take tokens too, see
    ``LayeredModel.takes_tokens``). ``per_position``: its output has logits at every
    position (``[B, T, V]`` against targets ``[B, T]``, positions equal to
    ``IGNORE_INDEX`` not scored); otherwise one row of logits per sample (``[B, K]``
    against ``[B]``). ``accuracy``: held-out scores count the predictions equal to the
    label. ``recipe``: what a run trains it with when it names no optimizer
    (pipeswap.optim.OptimizerConfig.filled).
    """

    name: str
    noun: str
    size: str
    takes_tokens: bool
    per_position: bool
    accuracy: bool
    recipe: Recipe

    @property
    def has_seq_len(self) -> bool:
        return self.size == SEQ_LEN

    @property
    def has_image_size(self) -> bool:
        return self.size == IMAGE_SIZE

    def check_sizes(
        self, model: str, seq_len: int | None, image_size: int | None, *, tokens: bool = False
    ) -> None:
        """Refuse the input size that does not apply to ``model`` (a ConfigError naming
        the one to pass); ``tokens``: the model reads token ids, which a classifier of
        this table's has no data for (a BertForSequenceClassification)."""
        if tokens and not self.takes_tokens:
            raise ConfigError(
                f"{model} classifies token sequences; pipeswap has no labelled text data to "
                "train it on: train it in your own loop with pipeswap.offload or "
                "pipeswap.Pipeline"
            )
        other, given = (IMAGE_SIZE, image_size) if self.has_seq_len else (SEQ_LEN, seq_len)
        if given is not None:
            raise ConfigError(f"{model} is {self.noun}: pass {{{self.size}}}, not {{{other}}}")


TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task(
            "lm",
            noun="a language model",
            size=SEQ_LEN,
            takes_tokens=True,
            per_position=True,
            accuracy=False,
            # GPT training's AdamW, warm-up and cosine decay; SGD at 0.05 diverges on deeper
            # models (issue 39: a 12-layer Llama went 5.75 -> 33 in 20 steps). 3e-3 is the
            # rate measured to train the README's examples in their few steps (its 4-block
            # GPT-2 on byte-level text: held-out loss -35% in 20 steps, where 1e-3 gives
            # -19%, and higher rates end worse after 200; an 8-block Llama -41%, SGD -21%:
            # docs/concepts.md, "Defaults by task").
            recipe=Recipe("adamw", 3e-3, 0.1, "cosine"),
        ),
        Task(
            "classify",
            noun="an image model",
            size=IMAGE_SIZE,
            takes_tokens=False,
            per_position=False,
            accuracy=True,
            recipe=Recipe("sgd", 0.05, 0.0, "constant"),  # the momentum SGD they always had
        ),
    )
}


def task_kind(name: str) -> Task:
    """The entry of the task ``name``; a ConfigError naming the known ones otherwise."""
    task = TASKS.get(name)
    if task is None:
        raise ConfigError(f"unknown task {name!r}; known: " + ", ".join(TASKS))
    return task


def scores_accuracy(model: object) -> bool:
    """Whether held-out scores of ``model`` count accuracy, by its ``task``'s entry (a
    module with no task, such as a user's encoder-decoder in its own loop: no)."""
    name = getattr(model, "task", None)
    return isinstance(name, str) and task_kind(name).accuracy
