"""`python -m pipeswap` runs the command-line tool."""

from pipeswap.cli import main

__all__: list[str] = []

raise SystemExit(main())
