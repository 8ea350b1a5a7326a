"""`python -m pipeswap` runs the command-line tool."""

from pipeswap.cli import main

raise SystemExit(main())
