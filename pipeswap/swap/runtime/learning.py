"""How a shape is learnt before any plan exists: a step within the memory of a plan, timed.

A plan needs a profile of the call it serves, and the profile needs a step of that call;
run as it is, that step would hold the no-swap peak that the budget exists to avoid. So
the step that is learnt runs the way the run's policy's most frugal plan would:
recomputing every layer where the policy may recompute (only each layer's input is kept;
each forward runs again right before its backward), or with every saved tensor in host
memory where it only swaps (torch's ``save_on_cpu``, parameters and buffers left where
they are). Policy ``none`` keeps everything, so its step runs as it is. Results are those
of the step run as it is, bit for bit (pipeswap.swap.runtime.recompute; a copy to host
and back changes no value). pipeswap.training.loop_profile turns what the meter read in
such a step into what the step run as it is would hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import cast

import torch
from torch import nn

from pipeswap.precision import uncached_casts
from pipeswap.profiling.meter import host_buffer
from pipeswap.swap.plan.policy_table import policy_entry
from pipeswap.swap.runtime.recompute import Recomputation
from pipeswap.swap.runtime.transfer import DeviceLedger

__all__ = [
    "LEARNT_BY",
    "SAID",
    "every_layer_recomputed",
    "every_saved_tensor_on_host",
    "learning_step",
    "learnt_by",
]

# How a step that is learnt runs: as it is, recomputing every layer, or saving on the host.
LEARNT_BY = ("as-is", "recomputing", "on-host")
SAID = {  # what a learnt step does, said in a step's stats
    how: f"runs {doing}, timed and metered, to plan it and every later shape "
    "(offload.plan_for(...) before the loop plans it)"
    for how, doing in (
        ("as-is", "as it is"),
        ("recomputing", "recomputing every layer"),
        ("on-host", "with every saved tensor on the host"),
    )
}


def learnt_by(policy: str) -> str:
    """How a shape is learnt under swap policy ``policy`` (one of :data:`LEARNT_BY`)."""
    if policy == "none":
        return "as-is"
    return "recomputing" if policy_entry(policy).recomputes else "on-host"


def learning_step(
    how: str, model: nn.Module, layers: dict[str, nn.Module]
) -> AbstractContextManager[None]:
    """The context a learnt step's forward runs in (``how``: one of :data:`LEARNT_BY`)."""
    if how == "recomputing":
        return every_layer_recomputed(layers)
    if how == "on-host":
        return every_saved_tensor_on_host(model)
    return nullcontext()


@contextmanager
def every_layer_recomputed(layers: dict[str, nn.Module]) -> Iterator[None]:
    """The forward run inside keeps only each layer's input, and its backward (whenever it
    runs) re-runs each layer's forward first, as a plan that recomputes every layer does.
    The wrappers come off at the end of the forward; the backward re-runs what they kept."""
    recomputation = Recomputation(layers, list(layers), DeviceLedger(), account=False)
    recomputation.install()
    recomputation.active = True
    try:
        with uncached_casts():  # as the steps run (SwapExecutor.forward)
            yield
    finally:
        recomputation.active = False
        recomputation.remove()


@contextmanager
def every_saved_tensor_on_host(model: nn.Module) -> Iterator[None]:
    """Every tensor the forward inside saves for the backward, but ``model``'s parameters
    and buffers, is copied to host memory no meter counts (pinned for a GPU) and copied
    back when the backward needs it: the device holds none of them in between."""
    resident = {t.untyped_storage()._cdata for t in chain(model.parameters(), model.buffers())}

    def pack(tensor: torch.Tensor) -> object:
        if (
            type(tensor) is not torch.Tensor  # a subclass (DTensor, float8) keeps its kind
            or tensor.layout != torch.strided
            or tensor.untyped_storage()._cdata in resident
        ):
            return tensor
        pin = tensor.device.type == "cuda"
        buffer = host_buffer(tensor.numel() * tensor.element_size(), pin=pin)
        host = buffer.view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor)
        return (tensor.device, host)

    def unpack(packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = cast(tuple[torch.device, torch.Tensor], packed)
        # A copy on the CPU too, so that a meter counts what a GPU would hold again.
        return host.to(device, copy=True)

    with uncached_casts(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
