"""`pipeswap train` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="(not yet available)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("pipeswap train is not available yet")
    return 2
