"""Pipelined model parallelism with weight prediction: schedules, partitioner, runtime, emulator."""

from pipeswap.pipeline.config import WEIGHT_MODES, PipelineConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.grid import render_grid
from pipeswap.pipeline.partition import Partition, parse_balance, partition
from pipeswap.pipeline.predict import official_distances, steady_distances, version_distances
from pipeswap.pipeline.result import PipelineResult
from pipeswap.pipeline.schedule import SCHEDULE_NAMES, Action, Schedule, build_schedule
from pipeswap.pipeline.taskgraph import pipeline_graph, pipeline_task_graph
from pipeswap.pipeline.validate import ScheduleError, simulate, validate

__all__ = [
    "SCHEDULE_NAMES",
    "WEIGHT_MODES",
    "Action",
    "Emulator",
    "Partition",
    "PipelineConfig",
    "PipelineResult",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "official_distances",
    "parse_balance",
    "partition",
    "pipeline_graph",
    "pipeline_task_graph",
    "render_grid",
    "simulate",
    "steady_distances",
    "validate",
    "version_distances",
]
