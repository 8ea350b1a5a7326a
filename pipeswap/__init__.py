"""pipeswap: train networks larger than one GPU with contention-aware swapping and pipelines."""

from pipeswap.errors import PipeswapError

__version__ = "0.1.0"

__all__ = ["PipeswapError", "__version__"]
