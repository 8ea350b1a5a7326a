"""Config fields declared once: default and help per field, checks whose errors name the field.

Each component owns a frozen, keyword-only dataclass of its settings next to its code
(``pipeswap.optim.OptimizerConfig``, ``pipeswap.swap.swap_config.SwapConfig``,
``pipeswap.schedule.pipeline_config.PipelineConfig``, ...). A field is declared with
:func:`option` (its default and the help the CLI shows) and checked once, in the
dataclass's ``__post_init__``. A failed check raises :class:`ConfigError`, whose message
names fields as ``{field}`` placeholders (field names are unique across every config):
a Python caller reads the field's name (``footprint_ratio is 0.5; ...``), and the CLI,
which alone knows flags, reads the flag that sets it (``--footprint-ratio is 0.5; ...``).
Mechanism code that checks a setting later (against a model, a profile) raises the same
error, so its message reads right in both places.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from pipeswap.errors import PipeswapError

__all__ = [
    "ConfigError",
    "field_types",
    "leaf_fields",
    "nested_config",
    "option",
    "replace_fields",
    "require",
    "value_type",
]

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    choices: Sequence[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    const: str | None = None,
) -> Any:
    """A config field with its default and help; ``parse`` reads the CLI's text (e.g. sizes).

    ``choices`` lists the values the field takes (the CLI offers them); help text names
    other fields as ``{field}`` placeholders, as :class:`ConfigError` messages do. ``const``:
    the flag may be given without its value, which then reads as ``const``.
    """
    metadata = {
        "help": help,
        "choices": choices,
        "parse": parse,
        "metavar": metavar,
        "const": const,
    }
    return dataclasses.field(default=default, metadata=metadata)


class ConfigError(PipeswapError):
    """A setting that cannot work. The message names settings as ``{field}`` placeholders
    (field names are unique across every config); :meth:`render` spells them."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(self.render(lambda name: name))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str]]:
        # Crossing a process boundary keeps the {field} placeholders, not their rendering.
        return (type(self), (self.message,))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with each ``{field}`` replaced by ``name_of(field)``."""
        return _PLACEHOLDER.sub(lambda m: name_of(m.group(1)), self.message)


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def nested_config(owner: type, name: str) -> type | None:
    """The config dataclass the field ``name`` of ``owner`` holds (None: a plain value)."""
    hint = field_types(owner).get(name)
    for candidate in typing.get_args(hint) or (hint,):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


@functools.cache
def field_types(owner: type) -> dict[str, Any]:
    """The resolved type of every field of the config class ``owner``."""
    return typing.get_type_hints(owner)


def value_type(hint: Any) -> Any:
    """The type a field holds when set, without ``None``: ``int | None`` gives ``int``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        return members[0] if len(members) == 1 else hint
    return hint


def leaf_fields(owner: type) -> Iterator[tuple[type, dataclasses.Field[Any]]]:
    """Every (config class, field) of ``owner``'s tree that :func:`option` declared."""
    for f in dataclasses.fields(owner):
        child = nested_config(owner, f.name)
        if child is not None:
            yield from leaf_fields(child)
        elif "help" in f.metadata:
            yield owner, f


def replace_fields(config: Any, **changes: Any) -> Any:
    """``config`` with fields anywhere in its tree replaced, each named by its unique name:
    ``replace_fields(run, lr=0.1, schedule="gpipe")`` reaches ``run.optim.lr`` and
    ``run.pipeline.schedule``. Every config on the way is built again, so checked again."""
    own = {f.name for f in dataclasses.fields(config)}
    mine = {k: v for k, v in changes.items() if k in own}
    rest = {k: v for k, v in changes.items() if k not in own}
    for f in dataclasses.fields(config):
        child = getattr(config, f.name)
        if not rest or not dataclasses.is_dataclass(child) or f.name in mine:
            continue
        names = {leaf.name for _, leaf in _all_fields(type(child))}
        inner = {k: v for k, v in rest.items() if k in names}
        if inner:
            mine[f.name] = replace_fields(child, **inner)
            rest = {k: v for k, v in rest.items() if k not in inner}
    require(not rest, f"no field named {', '.join(sorted(rest))} in {type(config).__name__}")
    return dataclasses.replace(config, **mine)


def _all_fields(owner: type) -> Iterator[tuple[type, dataclasses.Field[Any]]]:
    for f in dataclasses.fields(owner):
        yield owner, f
        child = nested_config(owner, f.name)
        if child is not None:
            yield from _all_fields(child)
