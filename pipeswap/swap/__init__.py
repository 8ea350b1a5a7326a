"""Contention-aware tensor swapping for data-parallel training: plans, policies, the executor.

The package imports nothing itself: ``pipeswap.swap.config`` is read by every config, and
the mechanisms live in their modules (``planner``, ``executor``, ...).
"""
