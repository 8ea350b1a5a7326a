"""Models as LayeredModels of named blocks: the zoo, a user's model by name, any nn.Module."""

from pipeswap.models import registry
from pipeswap.models.base import LayeredModel  # noqa: F401 - the type of every model here
from pipeswap.models.registry import *  # noqa: F403 - the zoo and a model by name

__all__ = registry.__all__
