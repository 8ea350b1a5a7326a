"""Pipeline schedules without torch: actions, each schedule's stage orders, the schedule and
weight-mode tables, and the pipeline's config that chooses among them.

Every config reads ``pipeswap.schedule.config``; the runtime that runs a schedule lives in
``pipeswap.pipeline``.
"""
