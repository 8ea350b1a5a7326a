"""One forward and backward of a model, run aside under a meter: what the device held at each
layer's edges, for a device whose meter cannot watch the user's own step (the CPU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pipeswap.models.base import LayeredModel
from pipeswap.models.meta_ops import meta_like_real
from pipeswap.models.state import untouched
from pipeswap.profiling.block_timing import BlockTiming, time_blocks
from pipeswap.profiling.meta_attention import meta_attention_like_cpu
from pipeswap.profiling.meter import DeviceMeter, MemoryMarks
from pipeswap.profiling.on_host import every_saved_tensor_on_host
from pipeswap.profiling.profile import StepMemory
from pipeswap.profiling.step import optimizer_state_bytes
from pipeswap.profiling.update_step import update_temporaries

__all__ = [
    "layered_step_memory",
    "metered_step",
    "module_step_memory",
    "output_loss",
    "output_tensors",
]


def metered_step(
    model: nn.Module,
    forward: Callable[[], Any],
    layers: dict[str, nn.Module],
    device: torch.device,
    *,
    holding: Any = (),
    exclude: Any = (),
    around: Callable[[], AbstractContextManager[Any]] = nullcontext,
    finish: Callable[[], Any] | None = None,
    timing: BlockTiming | None = None,
    keep_output: bool = False,
) -> tuple[BlockTiming, int]:
    """Run ``forward`` and a backward from its output under a :class:`DeviceMeter`, with
    the meter read at ``layers``' edges (``BlockTiming.marks``); returns the timing and the
    step's peak.

    The storage count (CPU) sees only what runs while it is on, so the whole step runs
    here, inside it: the backward starts from the output's ``loss`` when it has one (a
    Hugging Face model given labels), else from every floating output that needs a
    gradient, with gradients of ones. The gradients it makes are dropped: the parameters'
    ``.grad`` are put back as they were, and so are buffers and the random generators
    (``untouched``). ``around`` wraps the forward and ``finish`` runs after the backward (a
    swap executor's step and its end, to measure a plan). ``timing``: the one to fill (a
    fresh one by default). ``keep_output``: the output is held through the backward, as a
    loop that writes ``outputs = model(...); outputs.loss.backward()`` holds its logits
    (by default only the loss is, as ``loss = model(...).loss`` holds it).
    """
    timing = BlockTiming() if timing is None else timing
    params = [p for p in model.parameters() if p.requires_grad]
    # The backward fills fresh .grad tensors, as a loop that zeroes them to None does;
    # the caller's gradients are put back afterwards.
    kept_grads = [p.grad for p in params]
    stashed = [grad for grad in kept_grads if grad is not None]  # not the step's: left out
    meter = DeviceMeter(device, holding=holding, exclude=(*exclude, *stashed))
    # On meta the backward, run outside ``around``, also needs ops that take what their real
    # kernels take (pipeswap.models.meta_ops); elsewhere no mode slows the step.
    like_real = meta_like_real() if device.type == "meta" else nullcontext()
    with untouched(model), meter, like_real:
        timing.marks = MemoryMarks(meter)
        handles = time_blocks(layers, timing, device)
        try:
            for p in params:
                p.grad = None
            with around():
                output = forward()
            # A loop's backward runs after its autocast region, which drops the weight casts
            # autocast cached; this one runs inside the caller's region: drop them here.
            torch.clear_autocast_cache()
            roots = _roots(output)
            # Outputs without a loss are scored by the loop's own loss, which saves as much
            # again for its backward (cross-entropy its log-probabilities, a squared error its
            # differences): held beside them through the backward, as a stand-in for it.
            scored = output_loss(output) is None  # (a scalar output is the loss itself)
            stand_in = [t.detach().clone() for t, _ in roots if scored and t.dim() > 0]
            if not keep_output:
                del output
            if roots:
                with _outside_autocast(device):  # (its backward too, as a loop's runs)
                    torch.autograd.backward(
                        [root for root, _ in roots], grad_tensors=[ones for _, ones in roots]
                    )
            del roots, stand_in
            output = None
            if finish is not None:
                finish()
        finally:
            for handle in handles:
                handle.remove()
            for p, grad in zip(params, kept_grads):
                p.grad = grad
        peak = meter.peak
    return timing, max(peak, *timing.marks.peaks.values(), 0)


def _outside_autocast(device: torch.device) -> AbstractContextManager[Any]:
    """Autocast off: a backward called inside an autocast region runs its ops under it (the
    engine carries the region's state), casting what a loop's backward, run after its
    region, does not: a wav2vec2 step run aside under bf16 read 0.5 MB less in its backward
    than the loop's own, and its plan held 1.0196x its budget."""
    if device.type not in ("cpu", "cuda"):
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


def output_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed (a Hugging Face model given labels), else None."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.requires_grad else None


def _roots(output: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Where the backward starts: the loss the model computed, else its outputs."""
    loss = output_loss(output)
    if loss is not None:
        return [(loss, None if loss.dim() == 0 else torch.ones_like(loss))]
    return [
        (t, torch.ones_like(t))
        for t in output_tensors(output)
        if t.requires_grad and t.is_floating_point()
    ]


def output_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors of an output: in containers, and in a dataclass's fields (which the
    pytree takes for one leaf)."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from output_tensors(getattr(leaf, field.name))


def layered_step_memory(
    model: LayeredModel,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    optimizer: str,
    *,
    saved_on_host: bool = False,
) -> StepMemory | None:
    """What the meter reads during one whole-model step of a LayeredModel (any device,
    meta included: storages there have sizes too), as :func:`module_step_memory` reads it.

    ``saved_on_host``: the step runs with every saved tensor on the host
    (pipeswap.profiling.on_host; autocast's cache kept, as the step as it is keeps it),
    within the memory of a plan that swaps them all; the meter still reads what the step
    as it is would hold."""
    children = dict(model.named_children())
    layers = {name: children[name] for name in model.layer_names}
    timing = BlockTiming()  # (its marks count what the host holds for the step)

    @contextmanager
    def around() -> Iterator[None]:
        with meta_attention_like_cpu():
            if saved_on_host:
                with every_saved_tensor_on_host(model, layers, timing, drop_casts=False):
                    yield
            else:
                yield

    return module_step_memory(
        model,
        lambda: model.loss(model(inputs), targets),
        layers,
        device,
        optimizer,
        holding=(model, inputs, targets),
        around=around,
        timing=timing,
    )[1]


def module_step_memory(
    model: nn.Module,
    forward: Callable[[], Any],
    layers: dict[str, nn.Module],
    device: torch.device,
    optimizer: str,
    *,
    holding: Any = (),
    around: Callable[[], AbstractContextManager[Any]] = nullcontext,
    timing: BlockTiming | None = None,
) -> tuple[BlockTiming, StepMemory | None]:
    """One step of ``forward`` (and a backward from its output) run aside under the meter:
    its timing, and what the meter read with the optimizer state its steps would hold added
    to every reading, and the optimizer step's peak: the state, the gradients and one
    step's temporaries over the parameters, put back afterwards (0 where a step cannot
    run)."""
    # The step makes its own weight casts, as a loop's step under its own autocast region
    # does: a cast cached by an earlier step of the caller's region (measure's timed steps)
    # was made before the meter began, and the storage count would never see it.
    torch.clear_autocast_cache()
    timing, _ = metered_step(
        model, forward, layers, device, holding=holding, around=around, timing=timing
    )
    names = list(layers)
    memory = timing.step_memory(names)
    if memory is None:
        return timing, None
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    state = optimizer_state_bytes(optimizer, grads)
    with_state = timing.step_memory(names, memory.start_bytes + state)
    assert with_state is not None
    step = with_state.start_bytes + grads + update_temporaries(trainable, optimizer, device)
    return timing, replace(with_state, step_peak_bytes=step)
