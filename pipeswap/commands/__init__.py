"""Subcommands of the `pipeswap` CLI, one module each."""
