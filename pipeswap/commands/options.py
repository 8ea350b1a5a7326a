"""The CLI made from the configs: one flag per config field, and the one table of flag names.

A field's flag is ``--`` and its name with dashes (``seq_len``: ``--seq-len``) unless
:data:`FLAGS` names it otherwise. Its help, choices and default come from the field's
declaration (:func:`pipeswap.config_fields.option`); its check is the config's own. Messages of
:class:`pipeswap.config_fields.ConfigError` name fields as ``{field}``, which :func:`message`
spells as flags, so a CLI user reads flags and a Python caller reads field names.

Every flag of every command is made here, from a field: a flag two commands take is one
field both declare with :func:`add_options` (tests/commands/test_flag_table.py walks the
parsers). A command may word a shared field's help for its own use (``helps``: what its
``--out`` writes, its own default), never its name, type, choices or check.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from pipeswap.config_fields import ConfigError, field_types, value_type
from pipeswap.errors import PipeswapError

__all__ = [
    "FIELD_OF",
    "FLAGS",
    "REMOVED",
    "add_options",
    "flag_of",
    "flags_of",
    "given",
    "message",
    "option_fields",
    "removed_flags",
]

# Fields whose flag is not their name with dashes; the first flag is the one messages use.
FLAGS: dict[str, tuple[str, ...]] = {
    "policy": ("--swap-policy", "--policy"),
    "gpu_memory_bytes": ("--gpu-memory",),
    "time_limit_s": ("--time-limit",),
    "bucket_bytes": ("--bucket-size",),
    "timeout_s": ("--timeout",),
    "profile_path": ("--profile",),
    "memory_cap_bytes": ("--memory-cap",),
    "stages": ("--pipeline",),
    "grid_stages": ("--stages",),
    # The nested configs, as messages name a whole mode.
    "swap": ("--swap-policy",),
    "pipeline": ("--pipeline",),
}

# Flags a command no longer takes, and what to write instead: the parser's refusal of one
# says so (pipeswap.cli). A removed flag is no argument of any parser.
REMOVED: dict[tuple[str, str], str] = {
    ("profile", "--dtype"): "--dtype is gone: write --precision, as train takes it (fp32, "
    "bf16-mixed, fp16-mixed; for --dtype bfloat16 the nearest is --precision bf16-mixed, "
    "autocast with float32 weights, measured); a pure-bfloat16 profile is "
    "pipeswap.profiling.measure or estimate(..., dtype='bfloat16') in Python",
}

# The attribute add_options sets on each argument it makes: the config and field behind it.
FIELD_OF = "pipeswap_field"


# Flags a user brings from another command or tool, and what this command takes instead.
ELSEWHERE: dict[tuple[str, str], str] = {
    ("train", "--stages"): "--stages is --pipeline K in train (cut the model into K stages)",
    ("train", "--json"): "train prints no JSON: --report FILE writes its report as JSON",
}


def removed_flags(command: str | None, unknown: list[str], known: Sequence[str] = ()) -> list[str]:
    """What to write instead of each flag among ``unknown`` (``--dtype=x`` too) that was
    removed, belongs elsewhere, or is a near miss of one of the command's ``known`` flags."""
    hints = []
    for arg in unknown:
        flag = arg.split("=", 1)[0]
        said = REMOVED.get((command or "", flag)) or ELSEWHERE.get((command or "", flag))
        if said is None and flag.startswith("--"):
            close = difflib.get_close_matches(flag, known, n=2, cutoff=0.75)
            if close:
                said = f"{flag} is no option of {command}; did you mean {' or '.join(close)}?"
        if said is not None:
            hints.append(said)
    return hints


def flags_of(name: str) -> tuple[str, ...]:
    """Every flag that sets the field ``name``, the one messages use first."""
    return FLAGS.get(name) or ("--" + name.replace("_", "-"),)


def flag_of(name: str) -> str:
    return flags_of(name)[0]


def message(exc: PipeswapError) -> str:
    """What the CLI prints for ``exc``: a config error's fields spelt as flags."""
    if isinstance(exc, ConfigError):
        return exc.render(flag_of)
    return str(exc)


def option_fields(config: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``config`` declared with :func:`pipeswap.config_fields.option` (not nested)."""
    return [f for f in dataclasses.fields(config) if "help" in f.metadata]


def add_options(
    target: Any,
    config: type,
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
    no_default: tuple[str, ...] = (),
    helps: Mapping[str, str] | None = None,
) -> None:
    """An argument per option field of ``config`` on ``target`` (a parser or a group):
    those named in ``only`` (default every one), less those in ``skip``. The help of those
    in ``no_default`` shows no default (the command asks for them, or for another flag);
    ``helps`` words a field's help for this command (what it means here, its default here).

    Every argument defaults to None, so what was given is known (:func:`given`) and the
    config's own default applies to the rest.
    """
    for f in option_fields(config):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        kind = value_type(field_types(config)[f.name])
        own = (helps or {}).get(f.name)
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": None,
            "help": _help(f, show_default=f.name not in no_default)
            if own is None
            else ConfigError(own).render(flag_of),
        }
        if kind is bool:
            kwargs["action"] = "store_true"
        else:
            parse = f.metadata["parse"]
            kwargs["type"] = str if parse is not None else kind
            if f.metadata["choices"] is not None:
                kwargs["choices"] = f.metadata["choices"]
            if f.metadata["metavar"] is not None:
                kwargs["metavar"] = f.metadata["metavar"]
            if f.metadata.get("const") is not None:
                kwargs.update(nargs="?", const=f.metadata["const"])
        if f.name in required:
            kwargs["required"] = True
        action = target.add_argument(*flags_of(f.name), **kwargs)
        setattr(action, FIELD_OF, (config, f.name))


def _help(f: dataclasses.Field[Any], *, show_default: bool = True) -> str:
    text = ConfigError(f.metadata["help"]).render(flag_of)
    default = f.default
    if not show_default or default is dataclasses.MISSING or default is None or default is False:
        return text
    return f"{text} (default {default})"


def given(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The option fields of ``config`` the command line set, read with their parsers."""
    values = {}
    for f in option_fields(config):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        parse = f.metadata["parse"]
        if parse is None:
            values[f.name] = value
            continue
        try:
            values[f.name] = parse(value)
        except PipeswapError as error:  # the parser's own words, and the flag they are about
            raise ConfigError(f"{{{f.name}}} {value}: {error}") from None
    return values
