"""The pipeline schedules as a table: each ScheduleKind says how it orders, delays and holds units.

Every place that depends on the schedule asks its entry (:func:`schedule_kind`): the
config's choices and micro-batch default, :func:`pipeswap.schedule.timetable.build_schedule`,
the validator's ordering rules, the version distances and their delay-free form, the
partitioner's memory model and the grid's caption. A new schedule is one more entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from pipeswap.config_fields import ConfigError
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.schedule.orders import (
    OrderBuilder,
    async_orders,
    gpipe_orders,
    one_f_one_b_orders,
    peak_in_flight,
    two_bw_orders,
)

__all__ = ["SCHEDULES", "SCHEDULE_NAMES", "Caption", "InFlight", "ScheduleKind", "schedule_kind"]

# (num_stages, stage, micro_batches) -> units whose activations the stage holds at once.
InFlight = Callable[[int, int, int], int]
# (a stage's compute actions, micro-batches per step) -> what the stage does per step, for
# the grid's line under the stage.
Caption = Callable[[list[Action], int], str]


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule: how its stages order their passes, and what follows from that order.

    ``build`` gives each stage's compute order (:mod:`pipeswap.schedule.orders`).
    ``forward_lag``: a forward of mini-batch t runs after the stage's UPDATE(t - 1 -
    forward_lag), so it sees weights at most that many updates older than those its
    mini-batch's update is applied to; 0 is a synchronous schedule (a flush per
    mini-batch), None no bound but the pipeline's depth. ``takes_micro_batches`` False:
    the schedule pipelines whole mini-batches (one unit each). ``delay_free``: the
    ``delay`` argument of ``build`` that removes the schedule's delay (None: it has no
    delay-free form). ``stash_versions``: the weight versions other than the live one
    that a stage's in-flight forwards may have used (None: one per in-flight unit).
    ``spectrain_table``: the official SpecTrain distance table applies (its async 1F1B).
    ``in_flight`` and ``caption``: the partitioner's activation count per stage, and the
    grid printer's summary of a stage's phases. ``default_weights``: the weight mode
    (pipeswap.schedule.modes) the layout planner runs it with, whose extra weight copies
    count in its memory: the live weights on a synchronous schedule, the method its paper
    pairs it with on an asynchronous one.
    """

    name: str
    build: OrderBuilder
    forward_lag: int | None
    takes_micro_batches: bool
    in_flight: InFlight
    caption: Caption
    delay_free: int | None = None
    stash_versions: int | None = None
    spectrain_table: bool = False
    default_weights: str = "stale"

    @property
    def asynchronous(self) -> bool:
        """No flush: stages take delayed gradients (a forward may see older weights)."""
        return self.forward_lag != 0

    def default_micro_batches(self, num_stages: int) -> int:
        """Units per mini-batch when none are given: one per stage, or 1 (whole mini-batches)."""
        return num_stages if self.takes_micro_batches else 1

    def check_micro_batches(self, micro_batches: int | None) -> None:
        """Refuse micro-batches for a schedule that pipelines whole mini-batches."""
        if not self.takes_micro_batches and micro_batches not in (None, 1):
            raise ConfigError(
                f"{self.name} pipelines whole mini-batches and updates after every backward, "
                f"so it takes no {{micro_batches}} (got {micro_batches}); drop "
                "{micro_batches} or use {schedule} 1f1b"
            )

    def in_flight_units(self, num_stages: int, stage: int, micro_batches: int = 1) -> int:
        """How many units (micro- or mini-batches) keep activations on ``stage`` at once."""
        return self.in_flight(num_stages, stage, micro_batches)


@functools.lru_cache(maxsize=64)
def _two_bw_in_flight(num_stages: int, micro_batches: int) -> tuple[int, ...]:
    # The peak over the builder's order; 4 mini-batches reach the steady state
    # (mini-batch t's forwards overlap only t - 1's backwards).
    return tuple(peak_in_flight(order) for order in two_bw_orders(num_stages, 4, micro_batches))


def _phases(passes: list[Action]) -> str:
    """``warm-up 2F, steady 2x(F,B), cool-down 2B`` of a stage's passes."""
    kinds = [a.kind for a in passes]
    if ActionKind.B not in kinds:
        return f"warm-up {len(kinds)}F"
    # The F right before the first B opens the first steady (F,B) pair, and the B right
    # after the last F closes the last one.
    warm = max(kinds.index(ActionKind.B) - 1, 0)
    last_f = max((i for i, k in enumerate(kinds) if k is ActionKind.F), default=-1)
    cool = max(len(kinds) - last_f - 2, 0)
    steady = (len(kinds) - warm - cool) // 2
    return f"warm-up {warm}F, steady {steady}x(F,B), cool-down {cool}B"


def _passes(actions: list[Action]) -> list[Action]:
    return [a for a in actions if a.kind.is_pass]


def _gpipe_caption(actions: list[Action], m: int) -> str:
    return f"per step {m}F then {m}B, then flush + UPDATE"


def _flushed_caption(actions: list[Action], m: int) -> str:
    first_step = [a for a in _passes(actions) if a.unit // m == 0]
    return "per step " + _phases(first_step) + ", then flush + UPDATE"


def _two_bw_caption(actions: list[Action], m: int) -> str:
    every = "every B" if m == 1 else f"every {m} B (a mini-batch)"
    return _phases(_passes(actions)) + f", no flush, UPDATE after {every}"


def _async_caption(actions: list[Action], m: int) -> str:
    return _phases(_passes(actions)) + ", UPDATE after every B"


SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind
    for kind in (
        ScheduleKind(
            "gpipe",
            build=gpipe_orders,
            forward_lag=0,
            takes_micro_batches=True,
            in_flight=lambda n, k, m: m,
            caption=_gpipe_caption,
        ),
        ScheduleKind(
            "1f1b",
            build=one_f_one_b_orders,
            forward_lag=0,
            takes_micro_batches=True,
            in_flight=lambda n, k, m: min(n - k, m),
            caption=_flushed_caption,
        ),
        ScheduleKind(
            "async-1f1b",
            build=async_orders,
            forward_lag=None,
            takes_micro_batches=False,
            in_flight=lambda n, k, m: n - k,
            caption=_async_caption,
            spectrain_table=True,
            default_weights="spectrain",  # SpecTrain's prediction (Chen et al.)
        ),
        ScheduleKind(
            "2bw",
            build=two_bw_orders,
            forward_lag=1,
            takes_micro_batches=True,
            in_flight=lambda n, k, m: _two_bw_in_flight(n, m)[k],
            caption=_two_bw_caption,
            delay_free=0,
            # Forwards between two updates share one version (PipeDream-2BW's double buffer).
            stash_versions=1,
            default_weights="stash",
        ),
    )
}
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_kind(name: str) -> ScheduleKind:
    """The entry of the schedule ``name``; a ConfigError naming the valid ones otherwise."""
    kind = SCHEDULES.get(name)
    if kind is None:
        raise ConfigError(f"unknown {{schedule}} {name!r}; valid: " + ", ".join(SCHEDULES))
    return kind
