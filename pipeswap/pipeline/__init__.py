"""Pipelined model parallelism with weight prediction: schedules, partitioner, runtime, emulator."""

from pipeswap.pipeline.config import WEIGHT_MODES, PipelineConfig
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.partition import partition
from pipeswap.pipeline.result import PipelineResult
from pipeswap.pipeline.schedule import SCHEDULE_NAMES, Action, Schedule, build_schedule

__all__ = [
    "SCHEDULE_NAMES",
    "WEIGHT_MODES",
    "Action",
    "Emulator",
    "PipelineConfig",
    "PipelineResult",
    "Schedule",
    "build_schedule",
    "partition",
]
