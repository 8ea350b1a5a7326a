"""The model zoo: every network as a LayeredModel of named blocks, built by name."""

from pipeswap.models.base import LayeredModel
from pipeswap.models.registry import (
    ModelSpec,
    build_model,
    count_parameters,
    model_names,
    model_spec,
    shape_defaults,
)

__all__ = [
    "LayeredModel",
    "ModelSpec",
    "build_model",
    "count_parameters",
    "model_names",
    "model_spec",
    "shape_defaults",
]
