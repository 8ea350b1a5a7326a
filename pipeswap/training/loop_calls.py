"""What a user's forward call looks like to offload: its signature, the cache it asks for, and
refusals that name settings as offload's arguments do."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.profiling.meter import unmetered
from pipeswap.profiling.metered_step import output_loss, output_tensors

__all__ = [
    "CACHE_ARGUMENTS",
    "HeldOutputs",
    "Signature",
    "cut_from_caller",
    "called_module",
    "describe",
    "in_signed_modes",
    "modes_of",
    "offload_names",
    "on_device",
    "on_host",
    "refuse_transforms",
    "signature",
    "takes_use_cache",
    "trainable_mask",
    "without_cache",
]

# What a forward call looks like to a plan: every tensor's shape, dtype, device and
# whether it needs gradients (an integer matrix's: whether all its values are equal), every
# other argument's value, and the autocast dtype and module modes it runs under.
Signature = tuple[Any, ...]


def signature(args: Any, kwargs: Any, device: torch.device, modes: Any = ()) -> Signature:
    """The call's signature; ``modes``: its model's :func:`modes_of` (a module in train mode
    may save more: dropout's masks; a frozen parameter needs no saved input for its
    gradient), so a call in eval mode, or with other parameters frozen, has its own plan."""
    leaves, spec = tree_flatten((args, kwargs))
    uniform = _uniform([x for x in leaves if isinstance(x, torch.Tensor)])
    shape = tuple(
        (tuple(x.shape), x.dtype, x.device, x.requires_grad, uniform.get(id(x)))
        if isinstance(x, torch.Tensor)
        else repr(x)
        for x in leaves
    )
    cast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    return (str(spec), shape, (cast, modes))


def modes_of(model: nn.Module) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """The ``training`` flag of each of ``model``'s modules and the ``requires_grad`` of each
    of its parameters, in order (a call's signature)."""
    return tuple(m.training for m in model.modules()), tuple(trainable_mask(model))


def trainable_mask(model: nn.Module) -> tuple[bool, ...]:
    """Which of ``model``'s parameters need gradients, in order."""
    return tuple(p.requires_grad for p in model.parameters())


class HeldOutputs:
    """Whether the loop holds its model's outputs beyond the loss (``outputs = model(...);
    outputs.loss.backward()`` holds the logits through the backward): a forward's outputs
    still alive at the next forward. A step run aside for a plan then holds them through
    its backward too (pipeswap.profiling.metered_step's ``keep_output``)."""

    def __init__(self) -> None:
        self._watched: list[weakref.ref[torch.Tensor]] = []
        self._held_in_backward = False

    def watch(self, output: Any) -> None:
        """Watch a forward's output: its tensors other than the loss, where it has one (a
        step run aside starts its backward from the outputs themselves otherwise), alive
        when the loss's backward begins (a step function's own ``outputs``, gone by the
        next forward) or at the next forward."""
        loss = output_loss(output)
        # Tensors keep their Python object while anything holds them (autograd included).
        watched = [
            weakref.ref(t)
            for t in (output_tensors(output) if loss is not None else ())
            if t is not loss and t.requires_grad
        ]
        self._watched, self._held_in_backward = watched, False
        if watched and loss is not None and loss.grad_fn is not None:

            def at_backward(_: Any) -> None:
                if any(ref() is not None for ref in watched):
                    self._held_in_backward = True

            loss.grad_fn.register_prehook(at_backward)

    def held(self) -> bool | None:
        """Whether the last output watched was held through its backward or is still held
        (None: none was since the last call)."""
        if not self._watched:
            return None
        held = self._held_in_backward or any(ref() is not None for ref in self._watched)
        self._watched, self._held_in_backward = [], False
        return held


@contextmanager
def in_signed_modes(model: nn.Module, signed: Signature, device: torch.device) -> Iterator[None]:
    """Run a step aside for the call ``signed`` was made of in that call's module modes and
    autocast, whatever the forward it is planned in runs under (an evaluation with
    gradients on, in eval mode or without autocast, after a training step; a GAN's other
    step, with the parameters frozen or not): the plan is the training step's, measured as
    it ran. The modes are put back after."""
    cast, modes = signed[2]
    training, trainable = modes or ((), ())
    modules, params = list(model.modules()), list(model.parameters())
    now, grads_now = [m.training for m in modules], trainable_mask(model)
    if len(training) == len(modules) and len(trainable) == len(params):
        for module, mode in zip(modules, training, strict=True):
            module.training = mode
        for param, needed in zip(params, trainable, strict=True):
            param.requires_grad_(needed)
    try:
        with torch.autocast(device.type, dtype=cast, enabled=cast is not None):
            yield
    finally:
        for module, mode in zip(modules, now, strict=True):
            module.training = mode
        for param, needed in zip(params, grads_now, strict=True):
            param.requires_grad_(needed)


def _uniform(tensors: list[torch.Tensor]) -> dict[int, bool]:
    """For each integer or boolean matrix, whether all its values are equal. A model may
    save other tensors when they are: a Hugging Face attention mask with no padding is
    dropped (the causal kernel runs without it), so a plan made for a padded batch would
    not name what such a batch saves, and keep less than planned. One reading of each
    device for them all."""
    # Masks are a batch of rows: a vector (a classifier's labels) is left out, so that a
    # batch whose labels happen to be equal does not take a plan of its own.
    ints = [
        t
        for t in tensors
        if t.dim() >= 2 and t.numel() and not (t.is_floating_point() or t.is_complex())
    ]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in ints:
        by_device.setdefault(t.device, []).append(t)
    out: dict[int, bool] = {}
    for group in by_device.values():
        flags = torch.stack([(t == t.reshape(-1)[0]).all() for t in group]).tolist()
        out.update((id(t), bool(flag)) for t, flag in zip(group, flags, strict=True))
    return out


def takes_use_cache(forward: Any, model: torch.nn.Module | None = None) -> bool:
    """Whether a forward takes ``use_cache`` (a Hugging Face model, which builds a key/value
    cache in training forwards unless told not to): it names it, or, given the ``model``
    it belongs to, it takes ``**kwargs`` and a submodule's forward names it (where the
    keyword arguments go: GraniteMoE's causal LM, Gemma 3's classifier)."""
    parameters = _parameters(forward)
    if "use_cache" in parameters:
        return True
    if model is None or not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        return False
    kinds = {type(m): m for m in model.modules() if m is not model}
    return any("use_cache" in _parameters(m.forward) for m in kinds.values())


def _parameters(forward: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):  # a builtin or C function: it names no parameters
        return {}


# The keyword arguments that hand a Hugging Face forward a cache it writes as it runs:
# transformers' key-value cache (``cache`` since transformers 5, where ``past_key_values``
# is its deprecated name; Mamba's ``cache_params`` before), Reformer's
# ``past_buckets_states``, and RWKV's recurrent ``state``, which each layer overwrites in
# place whatever use_cache says.
CACHE_ARGUMENTS = ("past_key_values", "cache", "cache_params", "past_buckets_states", "state")


def without_cache(kwargs: dict[str, Any], args: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The call's keyword arguments with ``use_cache=False`` where the call does not say (as
    transformers' own gradient checkpointing does); a training call that asks for the cache
    is refused: the cache would keep the keys and values that a plan moves off the device
    or recomputes. So is one that hands the forward a cache (CACHE_ARGUMENTS, or a
    transformers Cache object under any name or position), whatever its type."""
    given = next((name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    if given is None:
        given = next((name for name, value in kwargs.items() if _is_cache(value)), None)
    if given is None and any(_is_cache(value) for value in args):
        given = "a Cache object"
    if given is not None:
        raise PipeswapError(
            f"{given} in a training forward under offload: a cache object keeps every "
            "layer's keys and values (or state) beyond their backward, and a recomputed layer "
            "would write its own twice, so neither swapping nor recomputing could free them "
            f"nor give the loop's result; train without a cache (leave {given} out)"
        )
    asked = kwargs.get("use_cache")
    if asked is None:
        return {**kwargs, "use_cache": False}
    if asked:
        raise PipeswapError(
            "use_cache=True in a training forward under offload: the cache keeps every "
            "layer's keys and values on the device beyond their backward, so neither "
            "swapping nor recomputing could free them; pass use_cache=False (or leave it "
            "out: offload then passes use_cache=False, as gradient checkpointing does)"
        )
    return kwargs


def _is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers Cache (DynamicCache, StaticCache, a family's own),
    told by its classes' names, without importing transformers."""
    return any(
        kind.__name__ == "Cache" and kind.__module__.startswith("transformers")
        for kind in type(value).__mro__
    )


def called_module(model: nn.Module) -> nn.Module:
    """``model``, refused where no plan can serve its calls: offload starts at its forward,
    and a container (nn.ModuleList, nn.ModuleDict) has none, so nothing would ever be
    planned; a model that skips layers at random while training (Hugging Face layer drop:
    wav2vec2's and SpeechT5's default configs) saves nothing for a skipped layer, where a
    plan names each layer's saved tensors (planning failed when one was skipped)."""
    name = type(model).__name__
    if type(model).forward is nn.Module.forward:
        raise ConfigError(
            f"offload wraps the module your loop calls, and {name} has no "
            "forward of its own (its layers are called by their parent's): pass the model, "
            "or the submodule whose forward runs these layers, e.g. offload(model)"
        )
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    settings = to_dict() if callable(to_dict) else {}
    dropping = {k: v for k, v in settings.items() if "layerdrop" in k and v}
    if dropping:
        said = ", ".join(f"{k}={v}" for k, v in dropping.items())
        raise ConfigError(
            f"{name} skips layers at random while training ({said}): a plan names each "
            "layer's saved tensors, and a skipped layer saves none. Build the model without "
            f"it ({', '.join(f'{k}=0.0' for k in dropping)} in its config or from_pretrained) "
            "to use offload"
        )
    return model


def on_host(call: tuple[Any, Any]) -> tuple[Any, Any]:
    """The call's tensors copied to the host (a plan made again moves them back). On the
    CPU too a copy, which no meter counts: as a GPU's, the loop's own batch is let go of
    once the loop drops it, and a plan's bookkeeping is not the device's memory."""

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != "cpu":
            return x.detach().cpu()
        with unmetered():
            return x.detach().clone()

    return tree_map(copy, call)


def refuse_transforms() -> None:
    """Refuse a forward inside a torch.func transform (grad, vmap, jacrev): its saved
    tensors are the transform's wrappers, which have no storage to move or count."""
    if torch._C._functorch.peek_interpreter_stack() is not None:
        raise PipeswapError(
            "offload: this forward runs inside a torch.func transform (grad, vmap, jacrev), "
            "whose saved tensors cannot be moved to the host: run the transform without "
            "offload, or take gradients with loss.backward() or torch.autograd.grad"
        )


def cut_from_caller(call: tuple[Any, Any]) -> tuple[Any, Any]:
    """The call as a step run aside takes it: each tensor that needs gradients becomes a
    leaf of its own (the same storage), so the aside backward stops at the model's inputs
    and never runs on into the caller's graph (an encoder's, a learnt prompt's: freed, or
    filled with a second gradient) nor into its ``.grad``."""

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return x.detach().requires_grad_()
        return x

    return tree_map(cut, call)


def on_device(call: tuple[Any, Any], device: torch.device) -> tuple[Any, Any]:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, call)


def describe(signature: Signature) -> str:
    """The call's tensor shapes, as a user would write them: ``4x128, 4x128``."""
    shapes = [leaf[0] for leaf in signature[1] if not isinstance(leaf, str)]
    return (
        ", ".join("x".join(str(d) for d in shape) or "scalar" for shape in shapes) or "no tensors"
    )


# offload()'s argument for a setting of SwapConfig that it names otherwise.
_ARGUMENT = {"gpu_memory_bytes": "gpu_memory"}


@contextmanager
def offload_names(model: nn.Module | None = None) -> Iterator[None]:
    """Refusals inside name the settings as :func:`offload` calls them (``gpu_memory``), and
    say where ``model`` recomputes its layers already (Hugging Face gradient checkpointing)."""
    try:
        yield
    except ConfigError as exc:
        # Raised without a name in this frame: a local would hold the exception, whose
        # traceback holds this frame (a cycle that keeps the forward's frames, and its
        # output and batch, alive until the garbage collector runs).
        raise _spelled(exc, model) from None


def _spelled(refused: ConfigError, model: nn.Module | None) -> ConfigError:
    spelled = ConfigError(refused.message)
    message = refused.render(lambda name: _ARGUMENT.get(name, name))
    if getattr(model, "is_gradient_checkpointing", False) and "smallest budget" in message:
        message += (
            f" ({type(model).__name__} recomputes its layers already: gradient checkpointing "
            "is on, so the step pipeswap measured and plans from is the checkpointed one; call "
            "model.gradient_checkpointing_disable() before offload to have pipeswap choose what "
            "to swap or recompute for the budget)"
        )
    spelled.args = (message,)
    return spelled
