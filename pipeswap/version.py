"""pipeswap's version (pyproject.toml's), read by the package root and every record that names it."""

__all__ = ["__version__"]

__version__ = "0.1.0"
