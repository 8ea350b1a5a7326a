"""Where a module is cut: its repeated blocks, and which modules run before and after them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from pipeswap.errors import PipeswapError

__all__ = [
    "candidate_layers",
    "check_block_paths",
    "every_stack",
    "find_blocks",
    "modules_around",
    "removed_after",
]


def find_blocks(model: nn.Module) -> list[str]:
    """The dotted paths of the model's repeated layer list: of the ``ModuleList`` and
    ``Sequential`` modules whose 2+ children share one class that a forward can call, the
    one with most parameters. A list of lists (Funnel's blocks, each a ModuleList of
    layers) is not one: its children have no forward, a model calls their layers. Where no
    list has children of one class, a hybrid's ``ModuleList`` of layers of several classes
    (OLMo hybrid's linear and full attention layers, alternating) is taken the same way (a
    ``Sequential`` of several classes is a chain of operations, not of layers)."""
    best: tuple[int, int, str] | None = None
    mixed: tuple[int, int, str] | None = None
    shared = ""  # a list holding one module more than once (layers that share weights)
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential) or len(module) < 2:
            continue
        if len({id(child) for child in module}) < len(module):
            shared = shared or f" ({path!r} holds one module more than once: a cut is a module"
            shared += " run once a forward, and layers that share their weights are not)"
            continue
        kinds = {type(child) for child in module}
        if any(kind.forward is nn.Module.forward for kind in kinds):
            continue
        count = sum(p.numel() for p in module.parameters())
        key = (count, -path.count("."), path)
        if len(kinds) == 1 and (best is None or key[:2] > best[:2]):
            best = key
        hybrid = len(kinds) > 1 and isinstance(module, nn.ModuleList)  # a Sequential: ops
        if hybrid and (mixed is None or key[:2] > mixed[:2]):
            mixed = key
    best = best or mixed
    if best is None:
        raise PipeswapError(
            f"{type(model).__name__} has no list of 2 or more layers of one class to cut at"
            f"{shared}; name its blocks (blocks={candidate_layers(model)}, its modules that "
            "run once a forward, in forward order; from the command line, with a "
            "module:function that returns pipeswap.adapt(model, blocks=[...]))"
        )
    parent = model.get_submodule(best[2])
    return [f"{best[2]}.{name}" if best[2] else name for name, _ in parent.named_children()]


def candidate_layers(model: nn.Module, most: int = 4) -> list[str]:
    """Paths of ``model``'s own modules a hint can name as its layers: its children that
    hold parameters, in the order they were made, the largest opened into its own while
    that names at most ``most`` (a model's body into its embeddings, encoder and head)."""

    def holding(path: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        return [
            (f"{path}.{name}" if path else name, child)
            for name, child in module.named_children()
            if next(child.parameters(), None) is not None
        ]

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    found = holding("", model)
    while found:
        largest = max(range(len(found)), key=lambda i: size(found[i][1]))
        inner = holding(*found[largest])
        if not inner or len(found) - 1 + len(inner) > most:
            break
        found[largest : largest + 1] = inner
    return [path for path, _ in found]


def every_stack(model: nn.Module) -> list[str]:
    """The blocks to swap around in a user's loop: :func:`find_blocks`'s, and for an
    encoder-decoder model (``config.is_encoder_decoder``: T5, BART, Whisper) its encoder's
    blocks before its decoder's, in the order its forward runs them (the decoder's list
    alone would leave every encoder activation on the device)."""
    config = getattr(model, "config", None)
    getters = [getattr(model, name, None) for name in ("get_encoder", "get_decoder")]
    if not getattr(config, "is_encoder_decoder", False) or not all(map(callable, getters)):
        return find_blocks(model)
    paths = {id(module): path for path, module in model.named_modules()}
    found: list[str] = []
    for get in getters:
        assert callable(get)
        stack = get()
        prefix = paths.get(id(stack))
        if prefix is None:
            return find_blocks(model)
        found += [f"{prefix}.{path}" if prefix else path for path in find_blocks(stack)]
    return found


def check_block_paths(model: nn.Module, paths: list[str]) -> None:
    """Refuse block paths that name no module of ``model``, or modules that overlap."""
    if not paths:
        raise PipeswapError("name at least one block")
    modules = dict(model.named_modules())
    for path in paths:
        if path not in modules or not path:
            raise PipeswapError(
                f"{type(model).__name__} has no module {path!r}; blocks are dotted module "
                f"paths such as {next(iter(p for p in modules if p), '?')!r}"
            )
    for a, b in zip(paths, paths[1:]):
        if a == b or b.startswith(a + ".") or a.startswith(b + "."):
            raise PipeswapError(f"blocks {a!r} and {b!r} overlap; name disjoint modules")


@contextmanager
def removed_after(hooks: list[RemovableHandle]) -> Iterator[None]:
    """Run the body, then remove ``hooks`` (whether the body raised or not)."""
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def modules_around(
    root: nn.Module, blocks: list[nn.Module], run: Callable[[], Any]
) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """Split the modules outside the blocks into those the forward calls before the first
    block (and those it never calls) and those it calls after the last block.

    ``run`` runs the model's forward once; a module it calls between two blocks is refused.
    """
    inside = {id(m) for block in blocks for m in block.modules()}
    holders = [
        (path, m)
        for path, m in root.named_modules()
        if path and id(m) not in inside and _holds_state(m)
    ]
    phase = {"now": "before"}
    where: dict[str, str] = {}
    handles = []
    for path, module in holders:

        def seen(_m: nn.Module, _args: Any, _path: str = path) -> None:
            where.setdefault(_path, phase["now"])

        handles.append(module.register_forward_pre_hook(seen))
    first, last = blocks[0], blocks[-1]
    handles.append(first.register_forward_pre_hook(lambda *_: phase.update(now="between")))
    handles.append(last.register_forward_hook(lambda *_: phase.update(now="after")))
    with removed_after(handles):
        run()
    between = [p for p, w in where.items() if w == "between"]
    if between:
        raise PipeswapError(
            f"the model's forward runs {', '.join(between)} between its blocks; pipeswap cuts "
            "only where blocks feed each other directly: name blocks that include them"
        )
    before = {p: m for p, m in holders if where.get(p, "before") == "before"}
    after = {p: m for p, m in holders if where.get(p) == "after"}
    return _outermost(before), _outermost(after)


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def _outermost(modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    # Registering a module and its parent would list the parent's parameters twice.
    return {p: m for p, m in modules.items() if not any(p.startswith(q + ".") for q in modules)}
