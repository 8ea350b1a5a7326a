"""Leaving a user's module as it was found: undo what a trial forward or backward changes."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.meta_ops import meta_like_real
from pipeswap.models.written import public_containers, public_scalars, put_back, written_back

__all__ = ["ModuleSnapshot", "inspecting", "untouched"]


@dataclass
class _ParamState:
    module: nn.Module
    name: str
    qualified: str  # the name in model.named_parameters(), for messages
    param: nn.Parameter
    grad: torch.Tensor | None
    requires_grad: bool
    version: int


@dataclass
class _BufferState:
    module: nn.Module
    name: str
    buffer: torch.Tensor
    values: torch.Tensor


class ModuleSnapshot:
    """What a training step without an optimizer can change in ``model``, kept to restore.

    Kept: the train/eval flag of every submodule; every parameter object, its ``.grad``
    object and ``requires_grad``; every buffer object and a copy of its values (BatchNorm
    statistics change in a training forward); each module's public number and flag
    attributes (a forward that counts its calls, a rotary cache's length beside its
    buffers), and what its public lists, dicts and sets hold (a forward that appends an
    auxiliary loss to a list the loop sums: a trial forward's would be summed too; the
    contents are put back in place, the objects are the loop's). Parameter values are not copied (that would double the model's memory): a
    step without an optimizer does not write them, and :meth:`restore` checks their
    version counters to be sure.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.training = [(module, module.training) for module in model.modules()]
        self.scalars = public_scalars(model)
        self.containers = public_containers(model)
        self.params: list[_ParamState] = []
        self.buffers: list[_BufferState] = []
        for prefix, module in model.named_modules():
            for name, param in module._parameters.items():
                if param is not None:
                    self.params.append(
                        _ParamState(
                            module,
                            name,
                            f"{prefix}.{name}".lstrip("."),
                            param,
                            param.grad,
                            param.requires_grad,
                            param._version,
                        )
                    )
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    self.buffers.append(_BufferState(module, name, buffer, buffer.detach().clone()))

    def restore(self, check: bool = True) -> None:
        """Put everything back; with ``check``, refuse if a parameter's values were written."""
        for module, training in self.training:
            module.training = training
        for module, name, value in self.scalars:
            setattr(module, name, value)
        for container, saved in self.containers:
            put_back(container, saved)
        with torch.no_grad():
            for b in self.buffers:
                b.module._buffers[b.name] = b.buffer
                # Always: BatchNorm's kernels update running statistics without bumping
                # the version counter, so it cannot tell which buffers changed.
                b.buffer.copy_(b.values)
        written = []
        for p in self.params:
            p.module._parameters[p.name] = p.param
            p.param.requires_grad_(p.requires_grad)
            p.param.grad = p.grad
            if p.param._version != p.version:
                written.append(p.qualified)
        if check and written:
            raise PipeswapError(
                f"{type(self.model).__name__}'s forward wrote parameters in place "
                f"({', '.join(sorted(set(written)))}), which the profiler cannot undo without a "
                "copy of every weight; keep parameter updates out of forward()"
            )


def _cuda_indices(model: nn.Module, devices: Iterable[torch.device | str]) -> list[int]:
    tensors = [*model.parameters(), *model.buffers()]
    found = {t.device for t in tensors} | {torch.device(d) for d in devices}
    cuda = [d for d in found if d.type == "cuda"]
    return sorted({torch.cuda.current_device() if d.index is None else d.index for d in cuda})


@contextmanager
def untouched(
    model: nn.Module, devices: Iterable[torch.device | str] = (), *, check: bool = True
) -> Iterator[None]:
    """Run the body, then leave ``model`` and the random generators as they were before.

    Restores what :class:`ModuleSnapshot` keeps, the CPU generator and the CUDA generators
    of the model's GPUs and of ``devices`` (dropout draws from them), and NumPy's and
    Python's global generators (a model's own code may draw from them: wav2vec2's
    SpecAugment masks come from NumPy's, which a pass run aside had moved on, so the
    loop's next masks differed from a loop without pipeswap). With ``check``, a parameter
    written in place by the body is a PipeswapError.
    """
    snapshot = ModuleSnapshot(model)
    numpy_state, python_state = numpy.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=_cuda_indices(model, devices)):
            try:
                yield
            except BaseException:
                snapshot.restore(check=False)  # the body's own error is the one to report
                raise
            snapshot.restore(check)
    finally:
        numpy.random.set_state(numpy_state)
        random.setstate(python_state)


@contextmanager
def inspecting(model: nn.Module) -> Iterator[None]:
    """Eval mode, no gradients: inspecting the model leaves it and the RNG as they were
    (parameters it writes in eval mode too: pipeswap.models.written). On the meta device
    its ops take what their real kernels take (pipeswap.models.meta_ops): a model is
    inspected there to read its spec before it is built."""
    with untouched(model, check=False), torch.no_grad(), written_back(model), meta_like_real():
        model.eval()
        yield
