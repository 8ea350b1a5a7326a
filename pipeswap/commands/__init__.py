"""Subcommands of the `pipeswap` CLI, one module each."""

__all__: list[str] = []
