"""OptimizerConfig and the optimizers pipeswap trains with: defaults, checks, construction."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
from torch import nn

from pipeswap.config_fields import ConfigError, option, require
from pipeswap.models.tasks import TASKS, task_kind

__all__ = [
    "DEFAULT_LR",
    "IMAGE_RECIPE",
    "LM_RECIPE",
    "LR_SCHEDULES",
    "NADAM_MOMENTUM_DECAY",
    "OPTIMIZERS",
    "PROFILE_OPTIMIZER",
    "STATE_BUFFERS",
    "OptimizerConfig",
    "make_nadam",
]

# Parameter-sized buffers each optimizer keeps: momentum SGD one, Adam(W) two.
STATE_BUFFERS = {"sgd": 1, "adam": 2, "adamw": 2}
OPTIMIZERS = tuple(STATE_BUFFERS)
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
# The optimizer whose state a profile counts when not told (pipeswap profile --optimizer):
# a profile is measured without a run, so without the task's default.
PROFILE_OPTIMIZER = "sgd"
LR_SCHEDULES = ("constant", "linear", "cosine")
_T = TypeVar("_T")


# Each task's recipe is its entry's (pipeswap.models.tasks, "Defaults by task" in
# docs/concepts.md); these two the --help text states.
LM_RECIPE = TASKS["lm"].recipe
IMAGE_RECIPE = TASKS["classify"].recipe


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer every mode updates with, and its learning rate over the steps.

    ``optimizer`` None leaves the optimizer to the model's task (its entry's recipe,
    pipeswap.models.tasks; :meth:`filled` picks it when the run is resolved against its model), and with it the
    rate, warm-up and schedule the user did not give; a named optimizer takes ``lr`` None
    as its default (:data:`DEFAULT_LR`), no warm-up and a constant rate. ``lr_warmup`` ramps
    the rate linearly: the update of mini-batch t uses ``lr * min(1, (t + 1) / lr_warmup)``;
    after it, ``lr_schedule`` keeps it (constant) or decays it to 0 over ``lr_decay_steps``
    updates counted from the start (linear, or cosine: ``lr * (1 + cos(pi p)) / 2`` with p
    the fraction of the decay done). :meth:`lr_at` is the rate of every mode. A run fills
    ``lr_decay_steps`` with its steps when it is not given (TrainConfig.resolved), so the
    horizon is fixed when the run starts: a run continued for more steps keeps it, and
    updates past it use a rate of 0 unless ``lr_decay_steps`` is given again.
    """

    optimizer: str | None = option(
        None,
        choices=OPTIMIZERS,
        help=f"the optimizer (default by the model's task: language models "
        f"{LM_RECIPE.describe()}; image models {IMAGE_RECIPE.describe()} "
        "(with {momentum}); naming it drops the task's warm-up and decay unless {lr_warmup}/{lr_schedule} "
        "are given too)",
    )
    lr: float | None = option(
        None,
        help="learning rate (default: the task's when {optimizer} is not given, else 0.05 "
        "for sgd, 1e-3 for adam and adamw)",
    )
    momentum: float = option(
        0.9,
        help="SGD momentum (with adam/adamw, the nesterov weight mode's beta1: NAdam's smoothing)",
    )
    weight_decay: float = option(0.0, help="weight decay (decoupled for adamw)")
    lr_warmup: int | None = option(
        None,
        metavar="STEPS",
        help="ramp the learning rate linearly over the first STEPS mini-batches, in every "
        "mode (0: none; default: the task's when {optimizer} is not given, else 0)",
    )
    lr_schedule: str | None = option(
        None,
        choices=LR_SCHEDULES,
        help="after the warm-up, keep the learning rate (constant) or decay it to 0 over "
        "{lr_decay_steps} (linear, cosine), in every mode (default: the task's when "
        "{optimizer} is not given, else constant)",
    )
    lr_decay_steps: int | None = option(
        None,
        metavar="STEPS",
        help="the updates, counted from the start, over which linear and cosine decay reach 0 "
        "(default: the run's {steps})",
    )
    accumulate: int = option(
        1,
        metavar="N",
        help="gradient accumulation: each update sums the gradients of N batches of {batch} "
        "samples, in every mode (data parallelism all-reduces with the last; a pipeline runs "
        "N times its micro-batches between updates)",
    )
    clip_grad_norm: float | None = option(
        None,
        metavar="NORM",
        help="scale the gradients so their global L2 norm is at most NORM before each update, "
        "in every mode (a pipeline's stages meet at each update to add up the norm: "
        "asynchronous schedules lose some overlap; default: no clipping)",
    )
    keep_nonfinite: bool = option(
        False, help="train on when the loss is not finite (by default the run stops there)"
    )

    def __post_init__(self) -> None:
        require(
            self.optimizer is None or self.optimizer in OPTIMIZERS,
            f"{{optimizer}} {self.optimizer!r} is not an optimizer pipeswap has; valid: "
            + ", ".join(OPTIMIZERS),
        )
        if self.optimizer is not None:
            # A named optimizer is complete: what it leaves unset is the plain default, so
            # only a config that leaves the optimizer to the task is filled later.
            if self.lr_warmup is None:
                object.__setattr__(self, "lr_warmup", 0)
            if self.lr_schedule is None:
                object.__setattr__(self, "lr_schedule", "constant")
        require(
            self.lr is None or (math.isfinite(self.lr) and self.lr > 0),
            f"{{lr}} is {self.lr}; use a positive number such as "
            f"{DEFAULT_LR[self.optimizer or LM_RECIPE.optimizer]:g}",
        )
        require(
            math.isfinite(self.momentum) and 0 <= self.momentum < 1,
            f"{{momentum}} is {self.momentum}; use a number in [0, 1) (SGD's momentum, the "
            "nesterov weight mode's beta1 with adam and adamw)",
        )
        require(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"{{weight_decay}} is {self.weight_decay}; use 0 or more",
        )
        require(self.accumulate >= 1, f"{{accumulate}} is {self.accumulate}; use 1 or more")
        require(
            self.clip_grad_norm is None
            or (math.isfinite(self.clip_grad_norm) and self.clip_grad_norm > 0),
            f"{{clip_grad_norm}} is {self.clip_grad_norm}; use a positive number such as 1.0",
        )
        require(
            self.lr_warmup is None or self.lr_warmup >= 0,
            f"{{lr_warmup}} must be 0 (no warm-up) or a number of steps, not {self.lr_warmup}",
        )
        require(
            self.lr_schedule is None or self.lr_schedule in LR_SCHEDULES,
            f"unknown {{lr_schedule}} {self.lr_schedule!r}; use one of " + ", ".join(LR_SCHEDULES),
        )
        require(
            self.lr_decay_steps is None or self.lr_decay_steps > (self.lr_warmup or 0),
            f"{{lr_decay_steps}} is {self.lr_decay_steps}; use more steps than {{lr_warmup}} "
            f"({self.lr_warmup}), or leave it to the run's steps",
        )

    def filled(
        self, task: str, steps: int | None, *, fits: Callable[[str], bool] | None = None
    ) -> OptimizerConfig:
        """This config with what it leaves to the task filled in, for a run of ``steps``
        training a model of ``task``: the task's recipe (its entry's) for every
        field not given, then ``lr_decay_steps`` the run's steps when the rate decays.

        ``steps`` None is a run of unknown length (pipeswap.Pipeline in a loop that does
        not know its own): the recipe's optimizer and rate, but no warm-up and a constant
        rate unless given, as both are fractions of the run; a decay needs
        ``lr_decay_steps``.

        ``fits`` says whether an optimizer suits the run's weight mode (spectrain predicts
        with SGD's momentum): a recipe whose optimizer does not is passed over for one
        that does, so leaving the optimizer unset never makes a mode refuse the run.
        """
        optim = self
        if optim.optimizer is None:
            recipes = [task_kind(task).recipe, *(t.recipe for t in TASKS.values())]
            recipe = next((r for r in recipes if fits is None or fits(r.optimizer)), recipes[0])
            warmup = 0 if steps is None else recipe.warmup(steps)
            optim = replace(
                optim,
                optimizer=recipe.optimizer,
                lr=recipe.lr if optim.lr is None else optim.lr,
                lr_warmup=warmup if optim.lr_warmup is None else optim.lr_warmup,
                lr_schedule=(
                    ("constant" if steps is None else recipe.schedule)
                    if optim.lr_schedule is None
                    else optim.lr_schedule
                ),
            )
        if optim.schedule != "constant" and optim.lr_decay_steps is None:
            require(
                steps is not None,
                f"{{lr_schedule}} {optim.schedule} decays to 0 over the run's steps, and this "
                "run does not say how many: give {lr_decay_steps}, or the run's steps",
            )
            assert steps is not None
            require(
                steps > optim.warmup,
                f"{{lr_schedule}} {optim.schedule} decays after {{lr_warmup}} "
                f"{optim.warmup} over the run's {{steps}} {steps}: train more steps, "
                "or give {lr_decay_steps}",
            )
            optim = replace(optim, lr_decay_steps=steps)
        return optim

    @property
    def name(self) -> str:
        """The optimizer this config builds (``sgd``, ``adam``, ``adamw``)."""
        return self._given(self.optimizer)

    @property
    def warmup(self) -> int:
        """``lr_warmup``, as given or filled."""
        return self._given(self.lr_warmup)

    @property
    def schedule(self) -> str:
        """``lr_schedule``, as given or filled."""
        return self._given(self.lr_schedule)

    def _given(self, value: _T | None) -> _T:
        # Only a config that leaves the optimizer to the task has unset fields; a run
        # fills them (TrainConfig.resolved) before anything builds or schedules with it.
        if value is None:
            raise ConfigError(
                "this OptimizerConfig leaves {optimizer} to the model's task, which only a "
                "run knows: give {optimizer} (sgd, adam or adamw), or train it through "
                "TrainConfig, whose resolved() fills it"
            )
        return value

    @property
    def lr_varies(self) -> bool:
        """Whether the learning rate changes over the steps (:meth:`lr_at` sets it each one)."""
        return self.warmup > 0 or self.schedule != "constant"

    @property
    def base_lr(self) -> float:
        """The learning rate after warm-up: ``lr``, or the optimizer's default."""
        return DEFAULT_LR[self.name] if self.lr is None else self.lr

    def lr_at(self, step: int) -> float:
        """The learning rate of the update of mini-batch ``step`` (0-based): warm-up, then
        the schedule (class docstring)."""
        if step + 1 < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        if self.schedule == "constant":
            return self.base_lr
        assert self.lr_decay_steps is not None, "a run fills lr_decay_steps with its steps"
        start = max(self.warmup - 1, 0)  # the first update at the full rate
        done = min(1.0, max(0.0, (step - start) / (self.lr_decay_steps - start)))
        if self.schedule == "linear":
            return self.base_lr * (1.0 - done)
        return self.base_lr * 0.5 * (1.0 + math.cos(math.pi * done))

    def check_loss(
        self, loss: float, step: int, *, model: nn.Module | None = None, inputs: Any = None
    ) -> None:
        """Stop a run whose loss at mini-batch ``step`` is no longer finite (unless
        ``keep_nonfinite``): every later step would train on NaN weights and report NaN,
        which must not end as a success. The message names the first non-finite parameter
        of ``model`` or the non-finite ``inputs``, when there is one."""
        if math.isfinite(loss) or self.keep_nonfinite:
            return
        culprit = _first_nonfinite(model, inputs)
        seen = f" ({culprit} is not finite)" if culprit else ""
        if step == 0 and culprit:
            cause = "the model or its data held non-finite values before any update; fix them"
        else:
            cause = (
                f"training diverged with {{optimizer}} {self.name} at learning rate "
                f"{self.lr_at(step):g}; lower {{lr}}, or ramp it up with {{lr_warmup}}"
            )
        raise ConfigError(
            f"the loss is {loss} at mini-batch {step}{seen}: {cause}; {{keep_nonfinite}} "
            "trains on regardless"
        )

    def build(
        self, params: Iterable[nn.Parameter], *, nesterov: bool = False
    ) -> torch.optim.Optimizer:
        """This optimizer over ``params`` with the single-tensor (foreach=False) kernels.

        Every mode builds its optimizer here, so a data-parallel run and a pipeline stage
        apply the same arithmetic to the same parameter. ``nesterov`` gives its Nesterov
        form, what the nesterov weight mode updates with: SGD with Nesterov momentum, or
        NAdam with ``momentum`` as beta1 for the Adam family (:func:`make_nadam`;
        AdamW-style decay unless ``optimizer`` is adam).
        """
        lr, decay = self.base_lr, self.weight_decay
        if nesterov and self.name == "sgd":
            return torch.optim.SGD(
                params,
                lr=lr,
                momentum=self.momentum,
                weight_decay=decay,
                nesterov=True,
                foreach=False,
            )
        if nesterov:
            return make_nadam(
                params,
                lr=lr,
                beta1=self.momentum,
                weight_decay=decay,
                decoupled=self.optimizer != "adam",
            )
        if self.name == "sgd":
            return torch.optim.SGD(
                params, lr=lr, momentum=self.momentum, weight_decay=decay, foreach=False
            )
        if self.name == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=decay, foreach=False)
        return torch.optim.AdamW(params, lr=lr, weight_decay=decay, foreach=False)


def _first_nonfinite(model: nn.Module | None, inputs: Any) -> str | None:
    """The first parameter of ``model`` holding NaN or inf, or the inputs if they do."""
    if model is not None:
        for name, param in model.named_parameters():
            if not bool(torch.isfinite(param.detach()).all()):
                return f"parameter {name!r}"
    leaves = inputs if isinstance(inputs, tuple | list) else (inputs,)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            if not bool(torch.isfinite(leaf.detach()).all()):
                return "the input"
    return None


# NAdam's momentum-decay schedule psi (torch.optim.NAdam's default, which the Nesterov
# method for asynchronous pipelines runs with: PluralisResearch/AsyncPP, optim/nadamw.py).
NADAM_MOMENTUM_DECAY = 0.004


def make_nadam(
    params: Iterable[nn.Parameter],
    *,
    lr: float,
    beta1: float,
    weight_decay: float,
    decoupled: bool = True,
) -> torch.optim.Optimizer:
    """NAdam (Nesterov-accelerated Adam) with the single-tensor (foreach=False) kernel.

    ``beta1`` is the momentum coefficient (the Nesterov method for asynchronous pipelines
    uses 0.99); ``decoupled`` selects AdamW-style weight decay (NAdamW) instead of L2.
    Per parameter and step t (torch.optim.NAdam, Dozat 2016), with g_t the gradient
    (+ weight_decay * theta when not decoupled; decoupled: theta *= 1 - lr * weight_decay):

        mu_t     = beta1 * (1 - 0.5 * 0.96 ** (t * psi))
        m_t      = beta1 * m_{t-1} + (1 - beta1) * g_t
        v_t      = beta2 * v_{t-1} + (1 - beta2) * g_t ** 2
        m_hat    = mu_{t+1} * m_t / (1 - prod_{i<=t+1} mu_i) + (1 - mu_t) * g_t / (1 - prod_{i<=t} mu_i)
        theta_t  = theta_{t-1} - lr * m_hat / (sqrt(v_t / (1 - beta2 ** t)) + eps)
    """
    return torch.optim.NAdam(
        params,
        lr=lr,
        betas=(beta1, 0.999),
        weight_decay=weight_decay,
        momentum_decay=NADAM_MOMENTUM_DECAY,
        decoupled_weight_decay=decoupled,
        foreach=False,
    )
