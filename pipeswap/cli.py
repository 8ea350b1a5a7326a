"""The `pipeswap` command: one subcommand per module under pipeswap.commands."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from pipeswap.commands import (
    demo,
    env,
    export,
    plan,
    profile,
    schedule,
    simulate,
    topology,
    train,
)
from pipeswap.commands.json_out import json_stdout
from pipeswap.commands.options import message, removed_flags
from pipeswap.dist.peers import LOST_PEERS, lost_peers
from pipeswap.dist.signals import sigterm_interrupts
from pipeswap.errors import PipeswapError, crash_line, debugging

__all__ = ["build_parser", "main"]

# Each module defines register(subparsers), which adds its parser with func=run(args) -> int.
_COMMANDS = (env, profile, topology, simulate, plan, schedule, train, export, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeswap",
        description="Train networks larger than one GPU: contention-aware swapping and "
        "pipelined model parallelism with weight prediction.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in _COMMANDS:
        command.register(subparsers)
    # A command that runs others (`pipeswap demo`) calls them through ``args.main``.
    parser.set_defaults(main=main)
    return parser


def _flags_of_command(parser: argparse.ArgumentParser, command: str | None) -> list[str]:
    """The flags the subcommand ``command`` takes (none without one)."""
    for action in parser._subparsers._actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return [flag for flag in action.choices[command]._option_string_actions]
    return []


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # A removed flag says what to write instead; anything else, as argparse says it.
        command = getattr(args, "command", None)
        hints = removed_flags(command, unknown, _flags_of_command(parser, command))
        if hints:
            parser.exit(2, f"pipeswap {args.command}: error: {'; '.join(hints)}\n")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with sigterm_interrupts(), json_stdout(bool(getattr(args, "json", False))):
            return int(args.func(args) or 0)
    except PipeswapError as exc:
        print(f"pipeswap {args.command}: error: {message(exc)}", file=sys.stderr)
        # 2: bad input (the message names the fix); a crashed rank sets its own status.
        return int(getattr(exc, "exit_status", 2))
    except BrokenPipeError:
        # The reader of our output went away (`pipeswap ... | head`): nothing to report.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # a crash: one line; the traceback only when asked for
        if debugging():
            raise
        if lost_peers(exc):
            print(f"pipeswap {args.command}: stopped: this rank {LOST_PEERS}", file=sys.stderr)
        else:
            print(f"pipeswap {args.command}: crashed: {crash_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # One line (what the ranks said as they stopped, when they did), and 128 + the
        # signal, as a shell reports it: 130 for SIGINT, 143 for SIGTERM.
        signum = int(getattr(exc, "signum", signal.SIGINT))
        said = getattr(exc, "message", None) or f"stopped by {signal.Signals(signum).name}"
        if args.command == "train" and getattr(exc, "message", None) is None:
            # A run stopped after a step names it (and its checkpoint); this one could not:
            # before its first step, or a pipeline without --checkpoint-dir, or Ctrl-C twice.
            said += ": no report or checkpoint was written"
        print(f"pipeswap {args.command}: {said}", file=sys.stderr)
        return 128 + signum


if __name__ == "__main__":
    raise SystemExit(main())
