"""The tensors outside a split's modules that its embed and head layers read.

A model's root may own parameters (a learned position table, ViT's ``cls_token`` and
``pos_embed``) and buffers, which its own forward reads before or after the blocks. No
child module holds them, so the embed and head layers of a replay split
(pipeswap.models.replay) adopt them: a parameter goes to the layer whose output depends on
it (both, tied, where both do; the embed layer where neither does), a buffer to both. The
layers then train, move and save them like their modules' tensors; after a move the root
reads the moved tensors (``.to()`` replaces a buffer, or a parameter of another kind).

A module's parameter may be read on both sides too: the forward calls the module before
the blocks and reads its weight after them (an output projection tied by writing
``h @ self.embed.weight.T``), or adds a tensor computed before the blocks to their output
(an embedding skip). The layer that holds the module holds the parameter; the other
layer, whose output depends on it as well, holds it too, so that a pipeline ties it
across its first and last stages (pipeswap.pipeline.shared) and it gets both gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeswap.errors import PipeswapError

__all__ = ["RootTensorHolder", "adopt_root_tensors", "follow_root_mode"]


class RootTensorHolder(nn.Module):
    """A layer that may hold some of ``root``'s own parameters and buffers by their names."""

    def __init__(self) -> None:
        super().__init__()
        self._root_params: list[str] = []
        self._root_buffers: list[str] = []

    def adopt(
        self,
        root: nn.Module,
        params: list[str],
        buffers: list[str],
        read: dict[str, nn.Parameter] | None = None,
    ) -> None:
        """Hold the root's own ``params`` and ``buffers`` by their names, and the ``read``
        parameters of modules the other layer holds (by their paths, dots as ``__``)."""
        for name in params:
            self._parameters[name] = root._parameters[name]
        for path, param in (read or {}).items():
            self._parameters[path.replace(".", "__")] = param
        for name in buffers:
            self._buffers[name] = root._buffers[name]
            if name in root._non_persistent_buffers_set:
                self._non_persistent_buffers_set.add(name)
        self._root_params, self._root_buffers = params, buffers

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)
        root: nn.Module = self.__dict__["replay"].root  # set by the layer, not a child
        for name in self._root_params:
            root._parameters[name] = self._parameters[name]
        for name in self._root_buffers:
            root._buffers[name] = self._buffers[name]
        return out


def adopt_root_tensors(root: nn.Module, layered: nn.Module, example: torch.Tensor) -> None:
    """Give ``root``'s own parameters and buffers to the layers that use them: which
    parameters the embed's and the head's outputs depend on is read from the autograd
    graph of one run of each on ``example`` (a frozen parameter is followed too)."""
    embed: RootTensorHolder = layered._modules["embed"]  # type: ignore[assignment]
    head: RootTensorHolder = layered._modules["head"]  # type: ignore[assignment]
    blocks = list(layered.children())[1:-1]
    inside = {id(p) for block in blocks for p in block.parameters()}
    outside = {n: p for n, p in root.named_parameters() if id(p) not in inside}
    params = [name for name in outside if "." not in name]  # the root's own
    buffers = [name for name, _ in root.named_buffers(recurse=False)]
    frozen = [p for p in outside.values() if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        with torch.enable_grad():
            packed = embed(example)
            before = _reached(packed)
            with torch.no_grad():  # the head takes what the last block hands on
                handed = packed
                for block in blocks:
                    handed = block(handed)
            after = _reached(_run_head(head, tuple(t.detach() for t in handed)))
    finally:
        for p in frozen:
            p.requires_grad_(False)
    held = {layer: {id(p) for p in layer.parameters()} for layer in (embed, head)}
    # A module's parameter the other layer's output depends on too (module docstring).
    read = {
        layer: {
            n: p
            for n, p in outside.items()
            if "." in n and id(p) in reached and id(p) not in held[layer]
        }
        for layer, reached in ((embed, before), (head, after))
    }
    in_head = [n for n in params if id(outside[n]) in after]
    in_embed = [n for n in params if id(outside[n]) in before or id(outside[n]) not in after]
    embed.adopt(root, in_embed, buffers, read[embed])
    head.adopt(root, in_head, buffers, read[head])


def _run_head(head: nn.Module, handed: tuple[torch.Tensor, ...]) -> Any:
    try:
        return head(handed)
    except PipeswapError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own code, whatever it raises
        raise PipeswapError(
            f"the model's code after its blocks fails with them stubbed ({type(exc).__name__}: "
            f"{exc}); it reads more of their outputs than the hidden state, which a pipeline "
            "cannot hand on (a mixture of experts' router logits: set output_router_logits="
            "False in its config; its auxiliary loss is then not added)"
        ) from exc


def follow_root_mode(layered: nn.Module, root: nn.Module) -> None:
    """The split's own modules (the layers around the model's modules) in the mode the
    model came in: a model in eval mode (as ``from_pretrained`` returns it) trains in eval
    mode, as a plain loop that does not call ``model.train()`` does, and the code outside
    its blocks (an embedding dropout) follows the blocks' mode, not a new module's."""
    for module in (layered, *layered.children()):  # not the model's modules they hold
        module.training = root.training


def _reached(outputs: Any) -> set[int]:
    """The ids of the leaf tensors (parameters) the autograd graph of ``outputs`` reaches."""
    tensors = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    found = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}
    stack: list[Any] = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found
