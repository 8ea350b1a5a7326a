"""Which plan serves a call: a plan made for a shape serves every call it covers.

A loop that pads each batch to its own longest sequence calls the model with a new shape
at almost every step. A plan made for one call serves any call of the same structure
(the same arguments, dtypes, devices and other values) whose every tensor is no larger in
any dimension: its layers save the same tensors in the same order, each no larger than
its host region, and what it holds at every moment is no more than the larger call held
(pipeswap.swap.runtime.step_tensors swaps a smaller tensor into its region). So only a call
that no plan covers needs a plan of its own: the first call of a structure is learnt (run
within a plan's memory, timed and metered), every later one is planned before its forward from the
calls measured (pipeswap.training.loop_derive).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.profiling.block_timing import BlockTiming
from pipeswap.profiling.profile import StepMemory
from pipeswap.training.loop_calls import (
    Signature,
    describe,
    in_signed_modes,
    on_device,
    trainable_mask,
)
from pipeswap.training.loop_derive import same_structure
from pipeswap.training.loop_new_shapes import derive_plan
from pipeswap.training.loop_plans import LoopPlanner
from pipeswap.training.shape_plan import ShapePlan

__all__ = ["ShapePlans", "covers", "describe", "largest_covered", "smallest_covering"]


def covers(large: Signature, small: Signature, *, values: bool = True) -> bool:
    """Whether a plan made for ``large`` serves a call of ``small``: the same structure, no
    dimension larger, and the same masks (``values=False``: whatever its masks hold)."""
    if not same_structure(large, small):
        return False
    for big, little in zip(large[1], small[1], strict=True):
        if isinstance(big, str):
            continue
        if values and big[-1] != little[-1]:  # whether an integer matrix's values are equal
            return False
        if any(b < s for b, s in zip(big[0], little[0], strict=True)):
            return False
    return True


def smallest_covering(signature: Signature, planned: Iterable[Signature]) -> Signature | None:
    """The smallest of ``planned`` that covers ``signature`` (None: none does)."""
    best: Signature | None = None
    for candidate in planned:
        if covers(candidate, signature) and (best is None or _size(candidate) < _size(best)):
            best = candidate
    return best


def _size(signature: Signature) -> int:
    total = 0
    for leaf in signature[1]:
        if not isinstance(leaf, str):
            count = 1
            for d in leaf[0]:
                count *= d
            total += count
    return total


def largest_covered(
    signature: Signature, planned: Iterable[Signature], *, values: bool = True
) -> Signature | None:
    """The largest of ``planned`` that ``signature`` covers (None: none; ``values``: see
    :func:`covers`)."""
    smaller = [c for c in planned if covers(signature, c, values=values)]
    return max(smaller, key=_size, default=None)


class ShapePlans:
    """A loop's plans by the call each was made for, and the plan that serves a call."""

    def __init__(self, planner: LoopPlanner, *, check_memory: bool = False) -> None:
        self.planner = planner
        self.plans: dict[Signature, ShapePlan] = {}
        self.declared: Signature | None = None  # the largest call, as plan_for gave it
        self.check_memory = check_memory  # a derived plan is checked by a step run aside
        self._trainable: tuple[bool, ...] | None = None  # requires_grad, parameter by parameter
        self._no_backward = 0  # learnt calls in a row that ran no backward
        # The gradient bytes held into a forward that the plans count (grads_held).
        self.grad_bytes = 0
        self.outputs_seen_held = False  # (outputs_held)
        # A call a larger call's plan covered saved tensors it does not name (a forward
        # that branches on a length): every call is planned on its own (step_ended).
        self.exact_only = False
        # LoopPlanner.plan_shape's settings, for a shape measured before it is refused.
        self.settings: Callable[[], dict[str, Any]] | None = None
        self._covered: tuple[Signature, ShapePlan, int] | None = None

    def serving(
        self, signature: Signature, args: Any, kwargs: Any, device: torch.device
    ) -> tuple[Signature | None, ShapePlan | None]:
        """The call whose plan serves this one, and the plan (None: none does yet, learn
        it: the first call of its structure). A plan whose measured step held too much is
        made again first; a call no plan covers is planned now, derived from the measured
        calls of its structure (pipeswap.training.loop_derive), and refused if no plan
        fits it (or run recomputing every layer), a call larger than plan_for's too."""
        covering = smallest_covering(signature, self.plans)
        self._covered = None
        if covering not in (None, signature) and self.exact_only:
            covering = None
        if covering is not None:
            planned = self.plans[covering]
            if planned.replan_due:
                assert planned.call is not None
                call = on_device(planned.call, device)
                with in_signed_modes(self.planner.model, covering, device):
                    planned = self.plans[covering] = self.planner.replan(planned, *call)
            if covering != signature and planned.executor is not None:
                self._covered = (signature, planned, planned.executor.unmatched)
            return covering, planned
        bases = [
            (sig, p.profile)
            for sig, p in self.plans.items()
            if p.derived_from is None and not p.recomputes_all and same_structure(sig, signature)
        ]
        if self.planner.budget_bytes is None or not bases:  # the first of its structure
            return None, None
        # What a refusal names: the largest shape planned within the budget no larger than
        # this one, whatever its masks.
        within = [sig for sig, p in self.plans.items() if not p.recomputes_all]
        smaller = largest_covered(signature, within, values=False)
        fits = "none no larger" if smaller is None else describe(smaller)
        declared = self.declared
        if declared not in (None, smaller) and not covers(declared, signature, values=False):
            # Beyond the largest the user declared: planned as any new shape, within the
            # same budget, and refused only where no plan fits it.
            fits += f" (offload.plan_for was given {describe(declared)})"
        planned = self.plans[signature] = derive_plan(
            self.planner,
            signature,
            (args, kwargs),
            bases,
            fits=fits,
            check=self.check_memory,
            settings=self.settings,
        )
        return signature, planned

    def step_ended(self) -> None:
        """A step a larger call's plan served has ended: if it saved tensors that plan does
        not name (kept on the device, beyond what the plan holds), the model's forward
        saves other tensors at other shapes, and every later call is planned on its own
        (derived, its tensors named: a forward more at each new shape); a warning says so."""
        covered, self._covered = self._covered, None
        if covered is None:
            return
        signature, planned, unmatched = covered
        assert planned.executor is not None
        if planned.executor.unmatched > unmatched and not self.exact_only:
            self.exact_only = True
            warnings.warn(
                f"pipeswap.offload: a batch of shape {describe(signature)} saved tensors that "
                "the plan of a larger shape serving it does not name (does the forward "
                "branch on a length?); they stayed on the device, beyond the budget; from "
                "the next step each shape is planned on its own",
                RuntimeWarning,
                stacklevel=3,
            )

    def plan(
        self,
        signature: Signature,
        call: tuple[Any, Any],
        timing: BlockTiming,
        memory: StepMemory | None,
        *,
        aside: bool = False,
        **settings: Any,
    ) -> None:
        """Plan a timed call (``settings``: LoopPlanner.plan_shape's); a step cut short
        leaves its timing incomplete, and the call is learnt again (``aside``, a call
        offload.plan_for ran for the user: PipeswapError)."""
        names = self.planner.layer_names
        if timing.gradless:
            raise PipeswapError(
                f"layers {', '.join(sorted(timing.gradless))} ran their forward with gradients "
                "off inside the model's forward (torch.utils.checkpoint with use_reentrant=True "
                "runs them so, as does torch.no_grad() in the model's code): offload moves what "
                "layers save for the backward, and they save nothing it can see. Checkpoint "
                "with use_reentrant=False (Hugging Face: gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})), or leave the "
                "recomputing to offload (policy='recompute'), or name in layers= only modules "
                "that run with gradients"
            )
        if not timing.complete(names):
            if aside:
                raise PipeswapError(
                    "offload.plan_for ran the call aside, but its backward did not reach "
                    f"every layer of {', '.join(names)}: give it a call whose loss depends "
                    "on every layer's output, as the loop's does"
                )
            self._no_backward = self._no_backward + 1 if not timing.backward_started else 0
            if self._no_backward == 2:
                warnings.warn(
                    "pipeswap.offload: the model ran no backward between two of its learnt "
                    "calls (a frozen teacher's forward with gradients on?): a call is "
                    "planned from its forward and backward, so none is, and each call is "
                    "learnt again; run a model that only runs forwards under "
                    "torch.no_grad(), where it saves nothing, and outside `with off:`",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return
        self._no_backward = 0
        fits = None
        mine = {k: v for k, v in self.plans.items() if _mask_of(k) == _mask_of(signature)}
        if mine:  # (a plan made with other parameters trainable says nothing of this call)
            largest = largest_covered(signature, mine)
            fits = "none of this structure" if largest is None else describe(largest)
        elif not self.plans:  # every call so far refused (a loop that caught the refusal)
            fits = "none yet"
        first = self.planner.budget_bytes is None
        try:
            with in_signed_modes(self.planner.model, signature, self.planner.device):
                self.plans[signature] = self.planner.plan_shape(
                    timing, call, memory, shape=describe(signature), fits=fits, **settings
                )
        except ConfigError as refused:
            if not first or aside:
                raise
            # The smallest it names is this call's, which a longer one then refuses.
            raise ConfigError(
                f"{refused} (for a batch of shape {describe(signature)}, the first the loop "
                "ran: a larger one needs more; offload.plan_for(**largest_batch) before the "
                "loop names the smallest for that)"
            ) from None

    def trainable_changed(self, model: nn.Module) -> bool:
        """Whether ``model``'s parameters that need gradients differ from the last call's.
        A call's signature holds them (a block unfrozen saves tensors another set's plan
        does not name), so each set has plans of its own, within the one budget: a GAN's
        discriminator, frozen for the generator's step, runs a plan in both. The plans of
        the set before the last change are kept too; older ones are let go of (gradual
        unfreezing leaves no plan, nor its host memory, behind)."""
        trainable = trainable_mask(model)
        changed = self._trainable is not None and trainable != self._trainable
        if changed:
            kept = {trainable, self._trainable}
            for signature, planned in list(self.plans.items()):
                if _mask_of(signature) not in kept:
                    if planned.executor is not None:
                        planned.executor.close()
                    del self.plans[signature]
        self._trainable = trainable
        return changed

    def outputs_held(self, held: bool | None) -> None:
        """Whether the loop was seen holding its model's outputs into the next forward
        (loop_calls.HeldOutputs; None: not seen). Plans measured with steps that dropped
        them are let go of once it is seen holding them: the next call is learnt and
        planned again, within the same budget. Once seen holding them, every later plan
        holds them (a loop may hold them at some steps only)."""
        if held is None or held == self.planner.keep_outputs or self.outputs_seen_held:
            return
        if held and self.plans:
            self.close()
        self.planner.keep_outputs = self.outputs_seen_held = held

    def grads_held(self, model: nn.Module, device: torch.device) -> None:
        """Gradients held into a forward (accumulated over micro-batches, or zeroed and kept
        by ``zero_grad(set_to_none=False)``) stay through it, beyond what a step that starts
        without them holds. The first time a forward holds more of them than the plans
        count, each plan is made again with every reading that much higher (steps that
        start without them then keep the budget by that much more)."""
        held = sum(
            p.grad.untyped_storage().nbytes()
            for p in model.parameters()
            if p.grad is not None and p.grad.device == device
        )
        extra = held - self.grad_bytes
        if extra <= 0:
            return
        self.grad_bytes = held
        for signature, planned in list(self.plans.items()):
            if planned.profile.memory is None or planned.recomputes_all:
                continue
            assert planned.call is not None
            call = on_device(planned.call, device)
            with in_signed_modes(self.planner.model, signature, device):
                self.plans[signature] = _holding_more(
                    self.planner, planned, extra, call, shape=describe(signature)
                )

    def close(self) -> None:
        for planned in self.plans.values():
            if planned.executor is not None:
                planned.executor.close()
        self.plans.clear()


def _mask_of(signature: Signature) -> tuple[bool, ...] | None:
    """The trainable parameters a call's signature was made with (None: not said)."""
    modes = signature[2][1]
    return modes[1] if modes else None


def _holding_more(
    planner: LoopPlanner, planned: ShapePlan, nbytes: int, call: tuple[Any, Any], *, shape: str
) -> ShapePlan:
    """``planned`` made again for steps that hold ``nbytes`` more throughout (gradients
    kept into the forward), within the same budget."""
    assert planned.profile.memory is not None
    profile = replace(planned.profile, memory=planned.profile.memory.moved(nbytes))
    policy = planned.heuristic
    again = planner.settle(
        profile,
        call,
        time.perf_counter(),
        shape=shape,
        fits=f"{shape} without the gradients held",
        check=False,
        configs=(None if policy is None else replace(planner.config, policy=policy),),
        derived_from=planned.derived_from,
        heuristic=policy,
    )
    if planned.executor is not None:
        planned.executor.close()
    again.planning_s += planned.planning_s
    return again
