"""Pipelined model parallelism with weight prediction: the runtime and its emulator.

What a schedule is, the tables it is chosen from, the partitioner and the task graph a
schedule is scored on need no torch and live below, in :mod:`pipeswap.schedule`; the
mechanisms live in their modules (``emulator``, ``runtime``, ...).
"""

__all__: list[str] = []
