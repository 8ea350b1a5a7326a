"""A user's model by name: ``module:function`` or a local Hugging Face directory, as a LayeredModel."""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.adapt import as_layered
from pipeswap.models.base import LayeredModel
from pipeswap.models.seeding import seeded

# The head classes pipeswap can train, by the end of their class name, and the task.
_HF_HEADS = (
    ("ForCausalLM", "lm"),
    ("LMHeadModel", "lm"),
    ("ForMaskedLM", "lm"),
    ("ForImageClassification", "classify"),
)
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# Byte-level LM data uses token ids 0..255; a masked LM without a mask token of its own
# uses the first id past them, or NUL (absent from source text) when there is none.
_BYTE_VOCAB = 256
_EXAMPLE_TOKENS = 8
_EXAMPLE_IMAGE = 32


def is_user_model(name: str) -> bool:
    """True for names ``load_user_model`` takes: ``module:function`` or an existing directory."""
    return ":" in name or os.path.isdir(name)


def hf_directory_has_weights(directory: str | os.PathLike[str]) -> bool:
    return any((Path(directory) / f).is_file() for f in _WEIGHT_FILES)


def load_user_model(
    name: str,
    *,
    device: torch.device | str = "cpu",
    seed: int | None = 0,
    blocks: Sequence[str] | None = None,
) -> LayeredModel:
    """Build the model ``name`` names on ``device`` as a LayeredModel.

    ``module:function``: the function (no arguments) returns a LayeredModel, any
    ``nn.Module``, or a Hugging Face model; a directory: a Hugging Face model saved with
    ``save_pretrained`` (``config.json`` naming its architecture, and weights when present),
    loaded offline. Without weights the parameters are a seeded random initialisation
    (``seed``; None: the global RNG). ``blocks`` names the modules to cut at (dotted
    paths); by default the model's repeated layer list.
    """
    device = torch.device(device)
    if os.path.isdir(name):
        model, info = _load_hf_directory(name, device, seed)
        return _adapt_hf(model, name, info, blocks)
    if ":" not in name:
        raise PipeswapError(
            f"{name!r} is neither a zoo model, a directory nor module:function; pass a zoo "
            "name, a Hugging Face model directory, or module:function"
        )
    function = _import_function(name)
    with seeded(device, seed), device:
        try:
            model = function()
        except Exception as exc:  # noqa: BLE001 - the user's code: say whose failure it is
            raise PipeswapError(
                f"{name}: calling {name.partition(':')[2]}() failed ({type(exc).__name__}: "
                f"{exc}); name a function "
                "that takes no arguments and returns an nn.Module"
            ) from exc
    if isinstance(model, LayeredModel):
        if blocks is not None:
            raise PipeswapError(f"{name} returns a LayeredModel, which has its blocks; drop blocks")
        return model
    if not isinstance(model, nn.Module):
        raise PipeswapError(
            f"{name} returned {type(model).__name__}, not an nn.Module; return the model"
        )
    if _is_hf(model):
        return _adapt_hf(model, name, _hf_info(model, name), blocks)
    return adapt(model, name=name, blocks=blocks)


def adapt(
    model: nn.Module,
    *,
    name: str | None = None,
    blocks: Sequence[str] | None = None,
    task: str | None = None,
) -> LayeredModel:
    """Any ``nn.Module`` (or Hugging Face model) as a LayeredModel, for the Python API.

    The task is read off the model when not given: a Hugging Face head class says it; a
    plain module whose first layer is an ``nn.Embedding`` is a language model, one whose
    first layer is an ``nn.Conv2d`` an image classifier.
    """
    if isinstance(model, LayeredModel):
        return model
    label = name or type(model).__name__
    if _is_hf(model):
        return _adapt_hf(model, label, _hf_info(model, label), blocks)
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv2d)), None)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if isinstance(first, nn.Embedding) and task in (None, "lm"):
        example = torch.arange(_EXAMPLE_TOKENS, device=device)[None] % first.num_embeddings
        return as_layered(
            model,
            example=example,
            task="lm",
            name=label,
            blocks=blocks,
            vocab_size=first.num_embeddings,
        )
    if isinstance(first, nn.Conv2d) and task in (None, "classify"):
        example = torch.zeros(1, first.in_channels, _EXAMPLE_IMAGE, _EXAMPLE_IMAGE, device=device)
        classes = _output_width(model, example)
        return as_layered(
            model,
            example=example,
            task="classify",
            name=label,
            blocks=blocks,
            num_classes=classes,
            in_channels=first.in_channels,
        )
    raise PipeswapError(
        f"cannot tell what {label} ({type(model).__name__}) computes: pipeswap trains language "
        "models (whose first layer is an nn.Embedding over token ids) and image classifiers "
        "(whose first layer is an nn.Conv2d); wrap other models in a LayeredModel"
    )


def _output_width(model: nn.Module, example: torch.Tensor) -> int:
    from pipeswap.models.adapt import _inspecting

    with _inspecting(model):
        out = model(example)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise PipeswapError(
            f"{type(model).__name__} returns {type(out).__name__} for images; an image "
            "classifier returns logits [batch, classes]"
        )
    return int(out.shape[1])


def _import_function(name: str) -> Callable[[], Any]:
    module_name, _, attr = name.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PipeswapError(
            f"cannot import {name!r} ({exc}); write module:function with the module on "
            "PYTHONPATH, e.g. my_models:build"
        ) from None
    if not callable(function):
        raise PipeswapError(f"{name} is a {type(function).__name__}, not a function")
    return function


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise PipeswapError(
            "Hugging Face models need the transformers package: pip install 'pipeswap[hf]'"
        ) from None
    return transformers


def _is_hf(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _load_hf_directory(
    directory: str, device: torch.device, seed: int | None
) -> tuple[nn.Module, dict[str, Any]]:
    config_path = Path(directory) / "config.json"
    if not config_path.is_file():
        raise PipeswapError(
            f"{directory} has no config.json; pass a directory written by a Hugging Face "
            "model's save_pretrained(), a zoo name, or module:function"
        )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise PipeswapError(f"{config_path}: not readable JSON ({exc})") from None
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if not architectures:
        raise PipeswapError(
            f'{config_path} names no architecture; add e.g. "architectures": '
            '["GPT2LMHeadModel"] (save_pretrained() writes it)'
        )
    transformers = _transformers()
    cls = getattr(transformers, str(architectures[0]), None)
    if cls is None:
        raise PipeswapError(
            f"{config_path}: transformers {transformers.__version__} has no class "
            f"{architectures[0]!r}; upgrade transformers or fix the architecture name"
        )
    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    if device.type == "meta":
        with torch.device("meta"):
            model = cls(config)
    elif hf_directory_has_weights(directory):
        load = cls.from_pretrained
        model = load(directory, local_files_only=True, config=config, dtype=torch.float32)
        model = model.to(device)
    else:
        with seeded(device, seed), device:
            model = cls(config)
    model.train()
    return model, _hf_info(model, directory)


def _hf_info(model: nn.Module, name: str) -> dict[str, Any]:
    cls_name = type(model).__name__
    task = next((t for suffix, t in _HF_HEADS if cls_name.endswith(suffix)), None)
    if task is None:
        heads = ", ".join(f"*{suffix}" for suffix, _ in _HF_HEADS)
        raise PipeswapError(f"{name}: {cls_name} has no head pipeswap trains; use a {heads} class")
    config: Any = model.config
    info: dict[str, Any] = {"task": task, "masked": cls_name.endswith("ForMaskedLM")}
    if task == "lm":
        vocab = int(config.vocab_size)
        if vocab < _BYTE_VOCAB:
            raise PipeswapError(
                f"{name} has a vocabulary of {vocab} tokens, but the byte-level LM data needs "
                f"{_BYTE_VOCAB} (token ids 0-255); set vocab_size to {_BYTE_VOCAB} or more"
            )
        info["vocab_size"] = vocab
        info["max_positions"] = _max_positions(config)
        mask = getattr(config, "mask_token_id", None)
        info["mask_token_id"] = (
            None
            if not info["masked"]
            else int(mask)
            if mask is not None
            else _BYTE_VOCAB
            if vocab > _BYTE_VOCAB
            else 0
        )
    else:
        labels = int(getattr(config, "num_labels", 0))
        if labels < 2:
            raise PipeswapError(
                f"{name} has num_labels={labels}; the procedural image data needs a "
                "classifier of 2 or more labels: set num_labels in its config"
            )
        info["num_classes"] = labels
        info["in_channels"] = int(getattr(config, "num_channels", 3))
        size = getattr(config, "image_size", None)
        info["image_size"] = int(size) if isinstance(size, int) else None
    return info


def _max_positions(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _adapt_hf(
    model: nn.Module, name: str, info: dict[str, Any], blocks: Sequence[str] | None
) -> LayeredModel:
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    accepts = inspect.signature(model.forward).parameters
    call_kwargs: dict[str, Any] = {"return_dict": True} if "return_dict" in accepts else {}
    if "use_cache" in accepts:
        call_kwargs["use_cache"] = False
    if info["task"] == "lm":
        length = min(_EXAMPLE_TOKENS, info["max_positions"] or _EXAMPLE_TOKENS)
        example = torch.arange(length, device=device)[None] % info["vocab_size"]
        layered = as_layered(
            model,
            example=example,
            task="lm",
            name=name,
            blocks=blocks,
            input_name="input_ids",
            output_fn=_logits,
            call_kwargs=call_kwargs,
            run_context=_meta_safe_masks,
            vocab_size=info["vocab_size"],
        )
        layered.mask_token_id = info["mask_token_id"]
    else:
        size = info["image_size"] or _EXAMPLE_IMAGE
        example = torch.zeros(1, info["in_channels"], size, size, device=device)
        layered = as_layered(
            model,
            example=example,
            task="classify",
            name=name,
            blocks=blocks,
            input_name="pixel_values",
            output_fn=_logits,
            call_kwargs=call_kwargs,
            num_classes=info["num_classes"],
            in_channels=info["in_channels"],
        )
    layered.fixed_image_size = info.get("image_size") if _fixed_size(model) else None
    layered.max_positions = info.get("max_positions")
    return layered


def _fixed_size(model: nn.Module) -> bool:
    # ViT-style models learn one position embedding per patch of their configured size.
    return "vit" in type(model).__name__.lower()


@contextmanager
def _meta_safe_masks(inputs: torch.Tensor) -> Iterator[None]:
    """On the meta device, skip transformers' check for packed sequences.

    The check reads position ids (``.item()``), which meta tensors cannot; pipeswap's
    batches are never packed, which is what the check finds on a real device.
    """
    if not inputs.is_meta:
        yield
        return
    masking: Any = importlib.import_module("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return
    masking.find_packed_sequence_indices = lambda ids: None if ids.is_meta else original(ids)
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output
