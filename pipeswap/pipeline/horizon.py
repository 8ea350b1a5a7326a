"""A pipeline fed one mini-batch per call that need not know how many: its schedule is built
some steps ahead of the calls, lengthened as they come, and drained at the end.

Every schedule kind is prefix-stable: the schedule of ``T`` steps and that of any longer
run have the same actions on every stage up to where the call of step ``T - 2`` stops
(:func:`pipeswap.pipeline.feed.step_ends`; tests/pipeline/test_horizon.py walks every kind).
Only the last step's call differs: it drains the mini-batches still in flight. So a
pipeline that runs the calls of a schedule of ``H`` steps up to step ``H - 2``, then
continues on a longer one, runs exactly the actions of the longer one; and one that stops
after ``T`` calls and finishes on the schedule of ``T`` steps runs exactly what a
pipeline built for ``T`` steps runs, bit for bit. Each switch checks that the actions
already run are the new schedule's first ones.
"""

from __future__ import annotations

from dataclasses import replace

from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.executor import StageExecutor
from pipeswap.pipeline.feed import step_ends
from pipeswap.pipeline.predict import version_distances
from pipeswap.pipeline.stage_cuts import StageCuts
from pipeswap.schedule.actions import Action
from pipeswap.schedule.timetable import Schedule
from pipeswap.train_config import TrainConfig

__all__ = ["FIRST_HORIZON", "ScheduleHorizon", "adopt_schedule"]

# Steps the first schedule of a pipeline of unknown length covers; each lengthening doubles
# it, so building schedules costs at most about twice what one of the run's length does.
FIRST_HORIZON = 64


class ScheduleHorizon:
    """Where each call of a pipeline fed step by step stops, on this stage (``stage``).

    ``steps`` given: the schedule of that many steps, as ``pipeswap train`` builds it.
    ``steps`` None: a schedule that covers the steps so far and more (``done`` already
    done, when continuing from a checkpoint), lengthened by :meth:`stop_after` as the
    calls come and cut to the steps done by :meth:`drain`.
    """

    def __init__(self, config: TrainConfig, stage: int, steps: int | None, done: int = 0):
        self.stage = stage
        self.fixed = steps is not None
        length = steps if steps is not None else max(FIRST_HORIZON, done + 2)
        self.config = replace(config, steps=length)
        self.schedule = pipeline_schedule(self.config)
        self.ends = self._ends()

    @property
    def steps(self) -> int:
        """The steps the current schedule covers."""
        return self.config.steps

    def stop_after(self, step: int, executor: StageExecutor) -> int:
        """The index of this stage's first action after the call of mini-batch ``step``;
        the schedule is lengthened first when that call would be its draining last."""
        if not self.fixed and step >= self.steps - 1:
            self._switch(max(2 * self.steps, step + 2), executor)
        return self.ends[step]

    def drain(self, done: int, executor: StageExecutor) -> tuple[Action, ...]:
        """Cut the schedule to the ``done`` steps run: the actions left to this stage, which
        finish the mini-batches in flight (none when ``done`` is 0)."""
        if not self.fixed and done > 0 and done != self.steps:
            self._switch(done, executor)
        if done == 0:
            return ()
        return self.schedule.actions[self.stage][executor.index :]

    def _switch(self, steps: int, executor: StageExecutor) -> None:
        config = replace(self.config, steps=steps)
        schedule = pipeline_schedule(config)
        ran = executor.index
        mine, before = schedule.actions[self.stage], self.schedule.actions[self.stage]
        if mine[:ran] != before[:ran]:
            raise AssertionError(
                f"{schedule.name}: the schedule of {steps} steps does not begin with the "
                f"{ran} actions stage {self.stage} ran on that of {self.steps}"
            )
        self.config, self.schedule = config, schedule
        self.ends = self._ends()
        adopt_schedule(executor, config, schedule)

    def _ends(self) -> list[int]:
        micro = self.config.require_pipeline().micro_batch_count
        return step_ends(self.schedule.actions[self.stage], micro, self.steps)


def adopt_schedule(executor: StageExecutor, config: TrainConfig, schedule: Schedule) -> None:
    """Continue ``executor`` on ``schedule`` (``config``'s), whose first actions are the ones
    it ran: everything it derived from the schedule, derived again. The delay-scaled rate
    stays: it is the steady state's, which no length changes."""
    stage, pipeline = executor.stage, config.require_pipeline()
    executor.config, executor.schedule = config, schedule
    weights = executor.weights
    weights.distances = version_distances(schedule, stage, pipeline.distances)
    weights.step_of = {u: schedule.step_of(u) for u in range(schedule.num_units)}
    if executor.tied is not None:
        executor.tied.replan(schedule)
    executor.scorer.num_units = schedule.num_units
    executor.cuts = StageCuts(executor.checkpoint, schedule, stage, config.steps)
