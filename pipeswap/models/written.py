"""Putting back what a forward writes into a model beyond its buffers: parameters written
in place, the modules' public numbers and flags, and their public lists, dicts and sets.

A model may change itself when it runs in eval mode: Hugging Face's RWKV divides the
weights of its later blocks in place on its first eval forward (and sets a flag), and
multiplies them back on its next training forward. pipeswap runs a user's model in eval
mode to inspect it and to score held-out data; left so, a model would train on divided
weights (a snapshot that puts the flag back) or multiply them back in the middle of a
pipeline stage's step, after its blocks saved them for the backward. :func:`written_back`
keeps a copy of each parameter before its first write (copy on write: a model that writes
none costs no copy) and puts values and flags back afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["public_containers", "public_scalars", "put_back", "written_back"]


def public_scalars(model: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """Each module's public number and flag attributes (``training`` aside), to put back."""
    return [
        (module, name, value)
        for module in model.modules()
        for name, value in vars(module).items()
        if type(value) in (int, float, bool) and not name.startswith("_") and name != "training"
    ]


def public_containers(model: nn.Module) -> list[tuple[Any, Any]]:
    """Each module's public list, dict and set attributes (one shared by several modules
    once) with a shallow copy of each: a forward that appends an auxiliary loss to a list
    the loop sums, or fills a dict of activations, changes them in place."""
    found: dict[int, tuple[Any, Any]] = {}
    for module in model.modules():
        for name, value in vars(module).items():
            if type(value) in (list, dict, set) and not name.startswith("_"):
                found.setdefault(id(value), (value, copy.copy(value)))
    return list(found.values())


def put_back(container: Any, saved: Any) -> None:
    """Give ``container`` (a list, dict or set) the contents of ``saved`` in place."""
    if isinstance(container, list):
        container[:] = saved
    else:
        container.clear()
        container.update(saved)


def _runs_with(model: nn.Module) -> list[nn.Module]:
    """``model``, and the model whose own forward runs its layers when it is a LayeredModel
    split at that model's blocks (pipeswap.models.replay: each layer's ``replay.root``,
    where such a model keeps its flags)."""
    found = {id(model): model}
    for layer in model.children():
        root = getattr(getattr(layer, "replay", None), "root", None)
        if isinstance(root, nn.Module):
            found.setdefault(id(root), root)
    return list(found.values())


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The tensor's storage, None for a subclass without one (a quantized or sharded
    weight: not one pipeswap can copy back)."""
    try:
        return int(tensor.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _CopyOnWrite(TorchDispatchMode):
    """Keeps a copy of a parameter before an operation first writes into its storage."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.params = {
            key: p
            for model in models
            for p in model.parameters()
            if p.device.type != "meta" and (key := _storage_key(p)) is not None
        }
        self.kept: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for position, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = args[position] if position < len(args) else kwargs.get(argument.name)
                if isinstance(value, torch.Tensor):
                    self._keep(value)
        return func(*args, **kwargs)

    def _keep(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key is None or key in self.kept or key not in self.params:
            return
        param = self.params[key]
        self.kept[key] = (param, param.detach().clone())

    def put_back(self) -> None:
        with torch.no_grad():
            for param, values in self.kept.values():
                param.copy_(values)
        self.kept.clear()


@contextmanager
def written_back(model: nn.Module) -> Iterator[None]:
    """Run the body, then put back the values of the parameters it wrote in place and the
    modules' public numbers and flags (see the module docstring)."""
    models = _runs_with(model)
    scalars = [found for each in models for found in public_scalars(each)]
    keeper = _CopyOnWrite(models)
    try:
        with keeper:
            yield
    finally:
        keeper.put_back()
        for module, name, value in scalars:
            setattr(module, name, value)
