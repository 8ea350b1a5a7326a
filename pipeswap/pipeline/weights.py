"""Which weight version each pass of a stage sees: stale, stashed or predicted.

The module's parameters are what autograd saves in a forward graph. The optimizer
updates aliases of the same storage (``nn.Parameter(p.data)``) and versions are swapped
in through ``p.data``, so neither bumps the version counter autograd checks: a backward
runs on whatever weights are in place when it runs, which is what the modes choose.

``nesterov`` is the Nesterov method for asynchronous pipeline parallelism of Ajanthan
et al. (ICML 2025, arXiv 2505.01099) as its authors released it (PluralisResearch/AsyncPP:
``run.bash`` runs ``--optimizer nadamw --momentum 0.99``; ``main_with_runtime.py`` calls
``optimizer.load_old_params()`` before each backward and ``load_new_params()`` before each
step). A unit's forward runs on the live weights; its backward runs on the version its
forward used (PipeDream weight stashing, as ``stash``), so stage k's gradient of mini-batch
t is taken at version ``t - s_F`` (``s_F`` the forward's version distance, N - k - 1 in
steady state); the update applies that gradient to the live weights with NAdam (torch's
NAdam, decoupled weight decay for ``adamw``) whose momentum coefficient beta1 is the
config's ``momentum`` (:func:`pipeswap.optim.make_nadam`); with SGD, SGD with Nesterov
momentum (its SGD form, pipeswap's). With no delay (``s = 0``) it is plain NAdam(W) or SGD
training. The paper's own equations (its modified NAG look-ahead) were not available to
check this against; the released code is the definition used here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import require
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.predict import DIRECTED, Distances, group_of, step_direction
from pipeswap.pipeline.prediction_error import PassRecord, PredictionError, finite
from pipeswap.pipeline.spike_guard import SpikeGuard
from pipeswap.pipeline.tied_rates import built_rates, followed_rates
from pipeswap.profiling.meter import unmetered
from pipeswap.schedule.actions import ActionKind
from pipeswap.schedule.modes import WeightMode, weight_mode

__all__ = ["StageWeights", "squared_norm"]


@dataclass
class StageWeights:
    """The weights of one stage, its optimizer, and the version rule of its weight mode.

    ``distances`` maps (kind, unit) to the version distance ``s`` from
    :func:`pipeswap.pipeline.predict.version_distances`; ``step_of`` maps a unit to its
    mini-batch. With ``record``, every pass keeps the weights it saw so that, at the
    mini-batch's own update, the prediction error against the realized weights is known.
    The learning rate of each update follows ``optimizer_config.lr_at`` (linear warm-up), and a
    prediction over ``s`` updates sums the rates those updates will use.

    ``shared`` names this stage's copies of parameters tied across stages
    (:mod:`pipeswap.pipeline.shared`). Their gradients leave the stage instead of being
    applied at ``update``; each copy steps in :meth:`apply_shared` with an optimizer of
    its own, one update per mini-batch in mini-batch order, possibly later than the stage's
    other parameters. A prediction for a pass ``s`` stage updates ahead targets the same
    version for a copy: it also counts the updates the copy has not applied yet, so every
    copy of a tied parameter predicts the same weights for a mini-batch.

    ``clip_scales[t]``, when set, multiplies the gradient of mini-batch ``t`` (a tied
    copy's summed one too) before its update: clipping by the global norm, which the
    stages find together (pipeswap.pipeline.step_end).

    ``lr_scale`` multiplies the rate of each update of the stage's own parameters, for that
    step (a scheduler of the user's sets the rate it scales), and of its predictions (the
    delay-scaled rule: pipeswap.pipeline.predict.delay_lr_scale); tied copies keep theirs.
    ``guard_spikes`` turns on the stability rule's other half: a SpikeGuard scales down a
    gradient of the stage's own parameters whose norm is a spike against its recent ones
    (pipeswap.pipeline.spike_guard; after ``clip_scales``).
    """

    module: nn.Module
    mode: str
    distances: Distances
    step_of: dict[int, int]
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    record: bool = False
    keep_gradients: bool = False
    updates: int = 0
    errors: dict[str, PredictionError] = field(default_factory=dict)
    last_gradients: list[torch.Tensor] | None = None
    shared: dict[str, nn.Parameter] = field(default_factory=dict)
    # The model's own parameter of each tied copy, by name (what optimizer functions see).
    originals: dict[str, nn.Parameter] = field(default_factory=dict)
    clip_scales: dict[int, float] = field(default_factory=dict)
    # Builds each optimizer instead of ``optimizer_config`` (pipeswap.Pipeline's optimizer=).
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None
    lr_scale: float = 1.0
    guard_spikes: bool = False

    def __post_init__(self) -> None:
        self.entry: WeightMode = weight_mode(self.mode)
        self.spike_guard = SpikeGuard() if self.guard_spikes else None
        self.params = [p for p in self.module.parameters()]
        self.masters = [nn.Parameter(p.data) for p in self.params]
        where = {id(p): i for i, p in enumerate(self.params)}
        # name -> position in params of each copy of a parameter tied across stages.
        self.shared_at = {name: where[id(p)] for name, p in self.shared.items()}
        tied = set(self.shared_at.values())
        # A stage may own no parameters at all (e.g. a lone Flatten): nothing to update.
        self.optimizer: torch.optim.Optimizer | None = None
        # What an optimizer function is shown: the model's parameters (a tied copy's original).
        original = {id(p): self.originals.get(name, p) for name, p in self.shared.items()}
        self.shown = [original.get(id(p), p) for p in self.params]
        own = [i for i in range(len(self.masters)) if i not in tied]
        # Tied copies' first: the last optimizer built (whose scheduler a script keeps) is
        # the stage's own, whose rates the copies follow (pipeswap.pipeline.tied_rates).
        self.shared_optimizers = {
            name: self._make_optimizer([i]) for name, i in self.shared_at.items()
        }
        if own:
            self.optimizer = self._make_optimizer(own)
        if self.optimizer_factory is not None:
            self._check_factory()
        self._built = {n: built_rates(o) for n, o in self.shared_optimizers.items()}
        self._own_built = built_rates(self.optimizer)
        self.shared_applied = {name: 0 for name in self.shared_at}
        # Each tied copy's rates at its update's own UPDATE, which it applies later.
        self._shared_rates: dict[tuple[str, int], list[float]] = {}
        self.errors = {ActionKind.F.value: PredictionError(), ActionKind.B.value: PredictionError()}
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._latest_stash: tuple[int, list[torch.Tensor] | None] = (-1, None)
        self._backup: list[torch.Tensor] | None = None
        # Keys are plain strings ("F", unit): a checkpoint holds plain data only.
        self._records: dict[tuple[str, int], PassRecord] = {}

    def _check_factory(self) -> None:
        """Refuse an optimizer of the user's that this weight mode cannot run with (one
        pipeswap knows is checked as its config is: the Pipeline describes it as one)."""
        require(
            not self.entry.nesterov,
            f"weights={self.mode} updates with its own Nesterov form: pass an OptimizerConfig, not "
            "an optimizer function",
        )
        optimizer = self.optimizer
        if optimizer is None:
            return
        require(
            not self.entry.predicts or isinstance(optimizer, DIRECTED),
            f"weights={self.mode} predicts along the optimizer's step direction, which "
            f"pipeswap knows for SGD, Adam and AdamW, not {type(optimizer).__name__}: pass "
            "one of those, or another weights mode",
        )

    def _make_optimizer(self, positions: list[int]) -> torch.optim.Optimizer:
        masters = [self.masters[i] for i in positions]
        if self.optimizer_factory is None:
            return self.optimizer_config.build(masters, nesterov=self.entry.nesterov)
        # The user's function sees the model's own parameters (their groups are often
        # chosen by identity: no weight decay on norms), then steps the masters instead.
        shown = [self.shown[i] for i in positions]
        optimizer = self.optimizer_factory(shown)
        master_of = {id(p): m for p, m in zip(shown, masters)}
        for group in optimizer.param_groups:
            params = group["params"]
            strange = [p for p in params if id(p) not in master_of]
            require(
                not strange,
                f"the optimizer function returned an optimizer over {len(strange)} "
                "parameter(s) it was not given: build it over the list it receives (each "
                "stage passes its own parameters)",
            )
            params[:] = [master_of[id(p)] for p in params]  # in place: a list it kept
        optimizer.state.clear()  # keyed by parameter: nothing has stepped yet
        return optimizer

    # ---- passes -------------------------------------------------------------------
    @torch.no_grad()
    def before(self, kind: ActionKind, unit: int) -> None:
        """Put the version the mode chooses for this pass in place (remember the live one)."""
        now = self._flat() if self.record else None
        s = self.distances.get((kind, unit), 0)
        if self.entry.stashes:
            self._before_stash(kind, unit)
        elif self.entry.predicts and (s > 0 or self._lagging()):
            self._predict(s)
        if now is not None:
            used = self._flat() if self._backup is not None else now
            self._records[(ActionKind(kind).value, unit)] = PassRecord(now, used)

    @torch.no_grad()
    def after(self, kind: ActionKind, unit: int) -> None:
        """Restore the live weights after the pass."""
        if self._backup is not None:
            for p, saved in zip(self.params, self._backup):
                p.data.copy_(saved)
            self._backup = None

    def _before_stash(self, kind: ActionKind, unit: int) -> None:
        # Updates between F and B of the unit: only then does the backward need a stash.
        forward = self.distances.get((ActionKind.F, unit), 0)
        gap = forward - self.distances.get((ActionKind.B, unit), 0)
        if kind == ActionKind.F and gap > 0:
            # Forwards between two updates see one version: they share one copy of it
            # (PipeDream-2BW's double buffer holds 2 versions however many micro-batches).
            version, copy = self._latest_stash
            if version != self.updates or copy is None:
                copy = [p.detach().clone() for p in self.params]
                self._latest_stash = (self.updates, copy)
            self._stash[unit] = copy
        elif kind == ActionKind.B and unit in self._stash:
            self._backup = [p.detach().clone() for p in self.params]
            for p, stashed in zip(self.params, self._stash.pop(unit)):
                p.data.copy_(stashed)

    def _lagging(self) -> bool:
        return any(done < self.updates for done in self.shared_applied.values())

    def _predict(self, s: int) -> None:
        tied = {i: name for name, i in self.shared_at.items()}
        moves: list[tuple[nn.Parameter, torch.Tensor, float]] = []
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            if i in tied:
                optimizer: torch.optim.Optimizer | None = self.shared_optimizers[tied[i]]
                done = self.shared_applied[tied[i]]
            else:
                optimizer, done = self.optimizer, self.updates
            # The target is the stage's version updates + s: a copy that lags predicts more.
            ahead = s + self.updates - done
            scale = 1.0 if i in tied else self.lr_scale
            if optimizer is None or ahead <= 0:
                continue
            d = step_direction(optimizer, m)
            if d is None:
                continue
            if self.optimizer_config.lr_varies:
                # The next updates are those of mini-batches done .. done + ahead - 1.
                distance = scale * sum(self.optimizer_config.lr_at(done + j) for j in range(ahead))
            else:
                distance = ahead * (group_of(optimizer, m)["lr"] * scale)
            moves.append((p, d, distance))
        if not moves:
            return
        self._backup = [p.detach().clone() for p in self.params]
        for p, d, distance in moves:
            p.data.add_(d, alpha=-distance)

    # ---- updates ------------------------------------------------------------------
    @torch.no_grad()
    def update(self, step: int) -> None:
        """Apply the accumulated gradient of mini-batch ``step``, then clear it."""
        if self.record:
            self._score(step)
        tied = set(self.shared_at.values())
        scale = self.clip_scales.get(step, 1.0)
        if self.spike_guard is not None:
            scale *= self.spike_guard.factor(scale * math.sqrt(self.own_squared_norm()))
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            # A tied copy's gradient has left with shared_gradient: apply_shared steps it.
            # One without a gradient (frozen, or unused by this mini-batch) is skipped by
            # the optimizer, as in a plain loop: no weight decay, no momentum step.
            if i not in tied:
                m.grad = p.grad
                if scale != 1.0 and m.grad is not None:
                    m.grad.mul_(scale)
        if self.optimizer is not None:
            groups = self.optimizer.param_groups
            if self.optimizer_config.lr_varies:
                for group in groups:
                    group["lr"] = self.optimizer_config.lr_at(step)
            rates = [group["lr"] for group in groups]
            for group, lr in zip(groups, rates):
                group["lr"] = lr * self.lr_scale
            self.optimizer.step()
            for group, lr in zip(groups, rates):
                group["lr"] = lr
        for name, copy_optimizer in self.shared_optimizers.items():
            # A scheduler of the user's may move the rate before the copy steps (on an
            # asynchronous schedule): the copy's update takes this step's.
            if not self.optimizer_config.lr_varies:
                self._shared_rates[(name, step)] = followed_rates(
                    copy_optimizer, self._built[name], self.optimizer, self._own_built
                )
        if self.keep_gradients:
            # What this stage computed: a tied copy's own gradient, before the holders' sum.
            kept: list[torch.Tensor] = []
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                grad = (
                    (p.grad if p.grad is not None else torch.zeros_like(p)) if i in tied else m.grad
                )
                if grad is not None:
                    kept.append(grad)
            self.last_gradients = kept
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None
        self.updates += 1

    @torch.no_grad()
    def own_squared_norm(self) -> float:
        """The squared norm of the gradient of this stage's next update (tied copies out)."""
        tied = set(self.shared_at.values())
        return sum(
            squared_norm(p.grad)
            for i, p in enumerate(self.params)
            if i not in tied and p.grad is not None
        )

    @torch.no_grad()
    def shared_gradient(self, name: str) -> torch.Tensor:
        """A copy of this stage's gradient of the tied parameter ``name`` (zeros if unused)."""
        p = self.params[self.shared_at[name]]
        return p.grad.clone() if p.grad is not None else torch.zeros_like(p)

    @torch.no_grad()
    def apply_shared(self, name: str, grad: torch.Tensor, step: int) -> None:
        """Step this stage's copy of ``name`` with the holders' summed gradient of ``step``."""
        assert self.shared_applied[name] == step, "tied updates apply in mini-batch order"
        master = self.masters[self.shared_at[name]]
        optimizer = self.shared_optimizers[name]
        master.grad = grad
        if self.clip_scales.get(step, 1.0) != 1.0:
            grad.mul_(self.clip_scales[step])
        groups = optimizer.param_groups
        if self.optimizer_config.lr_varies:
            for group in groups:
                group["lr"] = self.optimizer_config.lr_at(step)
            optimizer.step()
        else:  # at the rates of its own UPDATE, put back after
            now = [group["lr"] for group in groups]
            for group, lr in zip(groups, self._shared_rates.pop((name, step), now)):
                group["lr"] = lr
            optimizer.step()
            for group, lr in zip(groups, now):
                group["lr"] = lr
        master.grad = None
        self.shared_applied[name] += 1

    @unmetered()
    def _score(self, step: int) -> None:
        future = self._flat()
        done = [key for key in self._records if self.step_of[key[1]] == step]
        for key in sorted(done):
            record = self._records.pop(key)
            error = self.errors[key[0]]
            error.used += float((record.used.double() - future.double()).norm())
            error.stale += float((record.now.double() - future.double()).norm())
            error.passes += 1

    def _flat(self) -> torch.Tensor:
        # A record on the CPU, which no device meter counts (a run does not hold it).
        with unmetered():
            if not self.params:
                return torch.zeros(0)
            return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])

    # ---- checkpoints --------------------------------------------------------------
    @torch.no_grad()
    def state(self) -> dict[str, Any]:
        """Everything the mode carries between passes (at an UPDATE boundary, no pass open)."""
        assert self._backup is None, "a checkpoint falls between passes"
        return {
            "params": [p.detach().clone() for p in self.params],
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "updates": self.updates,
            "errors": {k: (e.used, e.stale, e.passes) for k, e in self.errors.items()},
            "stash": self._stash,
            "records": {key: (r.now, r.used) for key, r in self._records.items()},
            "shared": {
                name: (self.shared_applied[name], opt.state_dict())
                for name, opt in self.shared_optimizers.items()
            },
            "clip_scales": dict(self.clip_scales),
            "spike_guard": self.spike_guard.state() if self.spike_guard is not None else None,
        }

    @torch.no_grad()
    def load_state(self, state: dict[str, Any]) -> None:
        for p, saved in zip(self.params, state["params"], strict=True):
            p.data.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        self.errors = {k: PredictionError(*v) for k, v in state["errors"].items()}
        self._stash = state["stash"]
        self._records = {key: PassRecord(*pair) for key, pair in state["records"].items()}
        for name, (applied, saved) in state.get("shared", {}).items():
            self.shared_applied[name] = applied
            self.shared_optimizers[name].load_state_dict(saved)
        self.clip_scales = dict(state.get("clip_scales", {}))
        if self.spike_guard is not None and state.get("spike_guard") is not None:
            self.spike_guard.load_state(state["spike_guard"])

    def prediction_error(self) -> dict[str, float | None]:
        """Per pass kind: ||W_hat - W_future|| / ||W_now - W_future|| summed over passes."""
        return {
            "forward": finite(self.errors[ActionKind.F.value].ratio),
            "backward": finite(self.errors[ActionKind.B.value].ratio),
        }


def squared_norm(tensor: torch.Tensor) -> float:
    """``tensor``'s squared L2 norm, summed in float64 (the same on every rank)."""
    return float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)) ** 2
