"""What replay splitting checks against the model's own run: the blocks' calls, the output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeswap.errors import PipeswapError, first_line
from pipeswap.models.base import LayeredModel
from pipeswap.models.blocks import removed_after

__all__ = [
    "Replayed",
    "check_reproduces",
    "context_of",
    "expected_calls",
    "hidden_of",
    "same_tensor",
]


class Replayed(Protocol):
    """What the checks read of a model being split (pipeswap.models.replay.Replay)."""

    @property
    def root(self) -> nn.Module: ...
    @property
    def paths(self) -> list[str]: ...
    @property
    def blocks(self) -> list[nn.Module]: ...
    @property
    def output_fn(self) -> Callable[[Any], torch.Tensor]: ...
    def run_root(self, inputs: torch.Tensor) -> Any: ...


def expected_calls(replay: Replayed, example: torch.Tensor) -> list[tuple[Any, Any, Any]]:
    """Each block's (args, kwargs, output) in a plain run of the model."""
    seen: list[tuple[Any, Any, Any]] = []
    hooks = [
        block.register_forward_hook(
            lambda _m, args, kwargs, out: seen.append((args, kwargs, out)), with_kwargs=True
        )
        for block in replay.blocks
    ]
    with removed_after(hooks):
        replay.run_root(example)
    if len(seen) != len(replay.blocks):
        raise PipeswapError(
            f"the model's forward called its {len(replay.blocks)} blocks {len(seen)} times; "
            "name blocks it calls exactly once each"
        )
    return seen


def check_reproduces(replay: Replayed, layered: LayeredModel, example: torch.Tensor) -> None:
    """Refuse a split whose layers compute other than the model: its forward reads more of
    a block's output than the hidden state (blocks' attention weights or caches that it
    uses), or calls them in a way the layers do not replay."""
    want = replay.output_fn(replay.run_root(example))
    if not isinstance(want, torch.Tensor):
        raise PipeswapError(
            f"{layered.name} returns a {type(want).__name__}: pipeswap trains a model whose "
            "forward returns its logits (a tensor); wrap it in a module whose forward "
            "returns the logits of what it returns (model(x)[0], model(x)['logits'])"
        )
    try:
        got = layered(example)
    except Exception as exc:  # noqa: BLE001 - the model's own code, whatever it raises
        raise PipeswapError(
            f"the model's forward does not run with its blocks cut apart ({type(exc).__name__}: "
            f"{first_line(exc)}); it reads more of a block's output than the hidden state: "
            "name other blocks"
        ) from exc
    same = got.shape == want.shape and (
        got.is_meta or bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))
    )
    if not same:
        _refuse_non_finite(replay.root, layered.name, want)
        raise PipeswapError(
            f"{layered.name} cut at its blocks ({', '.join(replay.paths[:2])}, ...) computes "
            "other outputs than the model: its forward reads more of a block's output than "
            "the hidden state; name other blocks"
        )


def _refuse_non_finite(root: torch.nn.Module, model: str, want: torch.Tensor) -> None:
    """NaN never equals NaN: a model whose weights or outputs are not finite cannot be
    checked, and is named as such rather than blamed on its blocks."""
    for name, param in root.named_parameters():
        if not bool(torch.isfinite(param.detach()).all()):
            raise PipeswapError(
                f"{model}'s parameter {name!r} holds NaN or inf: load finite weights "
                "(a checkpoint saved after training diverged holds such values)"
            )
    if not bool(torch.isfinite(want).all()):
        raise PipeswapError(
            f"{model}'s own forward gives NaN or inf on a sample batch: its weights "
            "or buffers hold values that are not finite; load finite weights"
        )


def context_of(hidden: Any, received: list[tuple[Any, ...]]) -> dict[int, torch.Tensor]:
    """The tensors the blocks receive besides the hidden state, by id, in first-use order."""
    context: dict[int, torch.Tensor] = {}
    for args, kwargs in received:
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and leaf is not hidden:
                context.setdefault(id(leaf), leaf)
    return context


def hidden_of(args: Any, kwargs: Any) -> Any:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise PipeswapError(
        "a block was called without a positional input or hidden_states=...; pipeswap "
        "passes the first positional argument from block to block"
    )


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "meta" or b.device.type == "meta":
        return a.shape == b.shape and a.dtype == b.dtype
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
