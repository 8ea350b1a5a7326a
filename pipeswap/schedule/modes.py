"""The weight modes as a table: which version each pass sees, with which optimizer, at what cost.

Every place that depends on the weight mode asks its entry (:func:`weight_mode`): the
config's choices and its check against the optimizer, the stage's weight versions
(:class:`pipeswap.pipeline.weights.StageWeights`), the optimizer it builds (NAdam or the
configured one), the partitioner's memory model and the per-layer delays of
:func:`pipeswap.pipeline.delayed.schedule_delays`. A new mode is one more entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template
from typing import TYPE_CHECKING

from pipeswap.config_fields import ConfigError

if TYPE_CHECKING:
    from pipeswap.optim import OptimizerConfig
    from pipeswap.schedule.kinds import ScheduleKind

__all__ = [
    "ADAM_FAMILY",
    "ANY_OPTIMIZER",
    "MOMENTUM",
    "NESTEROV_DELAY_LR_POWER",
    "NESTEROV_SGD_DELAY_LR_POWER",
    "PREDICTION_DELAY_LR_POWER",
    "SGD_MOMENTUM",
    "WEIGHT_MODES",
    "WeightMode",
    "weight_mode",
]

# P of the delay-scaled rate the recommended modes keep by default, measured in
# docs/results/pipeline_robustness.md: the predicting modes, and NAdam with weight stashing,
# which tolerates a milder rule (P = 1.25 lifted it from 36-73% to 83-122% of the staleness
# penalty on the language models at K = 4 with AdamW; P = 2 held its delayed stages too still).
PREDICTION_DELAY_LR_POWER = 2.0
NESTEROV_DELAY_LR_POWER = 1.25
# nesterov with SGD keeps SpecTrain's P: 1.25 let the GPT's delayed stages step too far
# (29% of the staleness penalty over three seeds at K = 4, lr 0.05, against 54% at P = 2).
NESTEROV_SGD_DELAY_LR_POWER = PREDICTION_DELAY_LR_POWER

# What a mode needs of the optimizer: nothing, SGD with momentum, the Adam family, or a
# momentum of either kind (SGD with momentum, or the Adam family).
ANY_OPTIMIZER = "any"
SGD_MOMENTUM = "sgd-momentum"
ADAM_FAMILY = "adam-family"
MOMENTUM = "momentum"


@dataclass(frozen=True)
class WeightMode:
    """One weight mode: the version a stage's passes run on, and what the mode needs.

    ``stashes``: the backward runs on the version its forward used (PipeDream's weight
    stashing); otherwise on the live weights. ``predicts``: a pass ``s`` updates ahead of
    its own update runs on ``W - s * lr * d``, ``d`` the optimizer's step direction
    (:func:`pipeswap.pipeline.predict.step_direction`: SGD's momentum buffer, Adam's
    ``m_hat / (sqrt(v_hat) + eps)``). ``optimizer`` is what it needs: ``any``,
    ``sgd-momentum``, ``adam-family`` or ``momentum`` (either); ``refusal`` says why when the config's optimizer
    is not that, naming settings as ``{field}`` (a :class:`pipeswap.config_fields.ConfigError`)
    and the config's values as ``$optimizer`` and ``$momentum``. ``nesterov``: the
    stage updates with the Nesterov form of the configured optimizer: SGD's Nesterov
    momentum, NAdam for the Adam family (:meth:`OptimizerConfig.build`).
    ``delay_lr_power``: P of the delay-scaled learning rate by default, nonzero for the
    modes pipeswap recommends (``PipelineConfig.delay_lr_power`` overrides it): a stage
    whose gradients arrive ``tau`` updates late steps at ``lr / (1 + tau) ** P``
    (:func:`pipeswap.pipeline.predict.delay_lr_scale`); 0, off. ``sgd_delay_lr_power``:
    its P with SGD, where that differs (:meth:`default_delay_lr_power`).
    """

    name: str
    stashes: bool = False
    predicts: bool = False
    optimizer: str = ANY_OPTIMIZER
    nesterov: bool = False
    refusal: str = ""
    delay_lr_power: float = 0.0
    sgd_delay_lr_power: float | None = None

    @property
    def recommended(self) -> bool:
        """A mode pipeswap recommends for asynchronous schedules: its stability rule is on."""
        return self.delay_lr_power > 0

    @property
    def live(self) -> bool:
        """Every pass runs on the live weights with the configured optimizer: the only
        thing a mode can mean on a synchronous schedule, where nothing is stale."""
        return not (self.stashes or self.predicts or self.nesterov)

    def default_delay_lr_power(self, optimizer: str | None) -> float:
        """P of the delay-scaled rate this mode keeps with the optimizer named ``optimizer``."""
        if optimizer == "sgd" and self.sgd_delay_lr_power is not None:
            return self.sgd_delay_lr_power
        return self.delay_lr_power

    def fits(self, optimizer: str) -> bool:
        """Whether this mode runs with the optimizer named ``optimizer`` (SGD's momentum
        aside): what a run whose optimizer is left to its task picks by."""
        if self.optimizer == SGD_MOMENTUM:
            return optimizer == "sgd"
        if self.optimizer == ADAM_FAMILY:
            return optimizer in ("adam", "adamw")
        return self.optimizer in (ANY_OPTIMIZER, MOMENTUM)

    def check_optimizer(self, optim: OptimizerConfig) -> None:
        """Raise ConfigError unless ``optim`` is an optimizer this mode can run with (one
        left to the task is picked to fit: OptimizerConfig.filled)."""
        if optim.optimizer is None:
            return
        fits = self.fits(optim.optimizer)
        if self.optimizer in (SGD_MOMENTUM, MOMENTUM) and optim.optimizer == "sgd":
            fits = fits and optim.momentum > 0
        if not fits:
            values = {"optimizer": optim.optimizer, "momentum": optim.momentum}
            raise ConfigError(Template(self.refusal).substitute(values))

    def extra_weight_copies(self, in_flight: int, schedule: ScheduleKind) -> int:
        """Weight copies beyond the live one, for the partitioner's memory model.

        A stash per in-flight unit (at most the schedule's ``stash_versions``: on ``2bw``
        every in-flight micro-batch ran its forward on one of two versions, so one copy),
        or one backup of the live weights while a predicted version is in place.
        """
        if self.stashes:
            versions = schedule.stash_versions
            return in_flight if versions is None else min(in_flight, versions)
        return 1 if self.predicts else 0

    def gradient_delay(
        self, schedule: str, stage: int, unit: int, walked: tuple[int, int], used: tuple[int, int]
    ) -> int:
        """How many updates late ``stage`` takes the gradient of ``unit``: a plain delay.

        ``walked`` is the (forward, backward) version distance of the unit's passes
        (:func:`pipeswap.pipeline.predict.version_distances`), ``used`` the one the config's
        distance rule gives. A mode that stashes takes its gradient at the forward's
        version; one that runs the backward on newer weights than the forward mixes two
        versions, and a prediction is no version at all: ConfigError, naming the mode.
        """
        forward, backward = walked
        if self.predicts and any(used):
            raise ConfigError(
                f"{schedule} with {{weights}} {self.name} predicts the weights of stage "
                f"{stage}: a prediction is no delay; use {{weights}} stash"
            )
        if not self.stashes and forward != backward:
            raise ConfigError(
                f"{schedule} with {{weights}} {self.name} runs stage {stage}'s forward of unit "
                f"{unit} {forward} updates behind but its backward {backward}: a gradient "
                "taken at two versions is no single delay; use {weights} stash"
            )
        return forward


WEIGHT_MODES: dict[str, WeightMode] = {
    mode.name: mode
    for mode in (
        WeightMode("stale"),
        WeightMode("stash", stashes=True),
        WeightMode(
            "spectrain",
            predicts=True,
            optimizer=SGD_MOMENTUM,
            delay_lr_power=PREDICTION_DELAY_LR_POWER,
            refusal="{weights} spectrain predicts with the SGD momentum buffer, but {optimizer} "
            "$optimizer {momentum} $momentum has none: use {optimizer} sgd {momentum} 0.9, or "
            "{weights} predict-adam with {optimizer} adam or adamw",
        ),
        WeightMode(
            "predict-adam",
            predicts=True,
            optimizer=ADAM_FAMILY,
            delay_lr_power=PREDICTION_DELAY_LR_POWER,
            refusal="{weights} predict-adam predicts with Adam's step direction: use "
            "{optimizer} adam or adamw, or {weights} spectrain for SGD with momentum",
        ),
        # Ajanthan et al. (arXiv 2505.01099) as released (NAdam; and its SGD form,
        # pipeswap's), with the stability rule on by default.
        WeightMode(
            "nesterov",
            stashes=True,
            optimizer=MOMENTUM,
            nesterov=True,
            delay_lr_power=NESTEROV_DELAY_LR_POWER,
            sgd_delay_lr_power=NESTEROV_SGD_DELAY_LR_POWER,
            refusal="{weights} nesterov updates with Nesterov momentum (the method of Ajanthan "
            "et al., arXiv 2505.01099), but {optimizer} $optimizer {momentum} $momentum has "
            "none: use {optimizer} sgd {momentum} 0.9 (SGD with Nesterov momentum), or "
            "{optimizer} adamw or adam (NAdam, as its authors released it)",
        ),
    )
}


def weight_mode(name: str) -> WeightMode:
    """The entry of the weight mode ``name``; a ConfigError naming the valid ones otherwise."""
    mode = WEIGHT_MODES.get(name)
    if mode is None:
        raise ConfigError(f"unknown {{weights}} {name!r}; valid: " + ", ".join(WEIGHT_MODES))
    return mode
