"""Pipelined model parallelism with weight prediction: partitioner, runtime, emulator.

What a schedule is, and the tables it is chosen from, need no torch and live below, in
:mod:`pipeswap.schedule`; the mechanisms live in their modules (``emulator``, ``runtime``,
...).
"""
