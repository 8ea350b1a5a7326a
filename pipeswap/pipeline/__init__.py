"""Pipelined model parallelism with weight prediction: schedules, partitioner, runtime, emulator.

The package imports nothing heavy itself: ``pipeswap.pipeline.config`` is read by every
config, with the tables it takes its choices from (``modes``: the weight modes,
``schedule_kinds``: the schedules), and the mechanisms live in their modules
(``emulator``, ``runtime``, ...).
"""
