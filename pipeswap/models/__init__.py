"""Models as LayeredModels of named blocks: the zoo, a user's model by name, any nn.Module."""

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
