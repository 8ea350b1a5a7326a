"""Pipeline schedules without torch: what a schedule is, and what is planned from it.

Two layers of docs/concepts.md share this folder. The tables a config chooses from sit in
``configs``, which every config reads: ``actions``, each schedule's stage ``orders``, the
schedule ``kinds``, the weight ``modes`` and the pipeline's ``config``. The rest is the
``schedule`` layer, above the simulator and below swap planning: ``timetable`` (the
:class:`~pipeswap.schedule.timetable.Schedule`: per-rank actions, their string and JSON
forms, their unit-time run), ``validate`` (its checks), ``partition`` (the cut of a model
into stages) and ``taskgraph`` (the task graph a schedule is scored on). The runtime that
runs a schedule lives in :mod:`pipeswap.pipeline`.
"""

__all__: list[str] = []
