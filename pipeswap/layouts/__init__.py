"""Layouts of a training job on a server: data parallel, pipelines, swapping stages, and mixes."""

__all__: list[str] = []
