"""Any nn.Module (a Hugging Face model too) as a LayeredModel, its task read off the model."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError, first_line
from pipeswap.models.base import LayeredModel
from pipeswap.models.replay import split_at_blocks
from pipeswap.models.state import inspecting
from pipeswap.models.tasks import task_kind

__all__ = ["adapt"]

# The head classes pipeswap can train, by the end of their class name, and the task.
_HF_HEADS = (
    ("ForCausalLM", "lm"),
    ("LMHeadModel", "lm"),
    ("ForMaskedLM", "lm"),
    # A decoder-only one (Gemma 3); encoder-decoders train whole (pipeswap.models.seq2seq).
    ("ForConditionalGeneration", "lm"),
    ("ForImageClassification", "classify"),
    ("ForSequenceClassification", "classify"),  # over token ids
)
# Byte-level LM data uses token ids 0..255; a masked LM without a mask token of its own
# uses the first id past them, or NUL (absent from source text) when there is none.
_BYTE_VOCAB = 256
_EXAMPLE_TOKENS = 8
_EXAMPLE_IMAGE = 32


def adapt(
    model: nn.Module,
    *,
    name: str | None = None,
    blocks: Sequence[str] | None = None,
    task: str | None = None,
    example: torch.Tensor | None = None,
) -> LayeredModel:
    """Any ``nn.Module`` (or Hugging Face model) as a LayeredModel cut at ``blocks``.

    ``blocks`` are dotted module paths (default: the model's repeated layer list, see
    pipeswap.models.blocks, or a plain ``nn.Sequential``'s children); the layers share the
    model's own modules (replay splitting, pipeswap.models.replay). A LayeredModel is
    returned as it is. The task is read off the model when not given: a Hugging Face head
    class says it; a plain module whose first layer is an ``nn.Embedding`` is a language
    model, one whose first layer is an ``nn.Conv2d`` an image classifier.

    ``example`` is an input the model takes (a batch of your token ids or images, one row
    is enough): the model runs on it once to learn how its forward calls the blocks. Left
    out, a plain module runs on 8 tokens or one 32x32 image; a model that takes only other
    shapes (a fixed sequence length) needs its own. A Hugging Face model runs on a probe
    its config allows.
    """
    if isinstance(model, LayeredModel):
        return model
    label = name or type(model).__name__
    if example is not None and not isinstance(example, torch.Tensor):
        raise PipeswapError(
            f"example is a {type(example).__name__}: pipeswap.adapt runs the model on one "
            "tensor (token ids or images), as model(example); for a forward that takes more "
            "(a mask), wrap it in a module whose forward takes that one tensor"
        )
    if _is_hf(model):
        return _adapt_hf(model, label, _hf_info(model, label), blocks)
    first = next((m for m in model.modules() if isinstance(m, nn.Embedding | nn.Conv2d)), None)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    entry = None if task is None else task_kind(task)
    if isinstance(first, nn.Embedding) and (entry is None or entry.takes_tokens):
        probe = torch.arange(_EXAMPLE_TOKENS, device=device)[None] % first.num_embeddings
        return _probing(
            split_at_blocks,
            model,
            label,
            given=example,
            example=probe if example is None else example.to(device),
            task=task or "lm",
            name=label,
            blocks=blocks,
            vocab_size=first.num_embeddings,
        )
    if isinstance(first, nn.Conv2d) and (entry is None or entry.has_image_size):
        image = torch.zeros(1, first.in_channels, _EXAMPLE_IMAGE, _EXAMPLE_IMAGE, device=device)
        image = image if example is None else example.to(device)
        classes = _probing(_output_width, model, label, given=example, example=image)
        return _probing(
            split_at_blocks,
            model,
            label,
            given=example,
            example=image,
            task=task or "classify",
            name=label,
            blocks=blocks,
            num_classes=classes,
            in_channels=first.in_channels,
        )
    raise PipeswapError(
        f"cannot tell what {label} ({type(model).__name__}) computes: pipeswap trains language "
        "models (whose first layer is an nn.Embedding over token ids) and image classifiers "
        "(whose first layer is an nn.Conv2d); another model (an MLP over features) is "
        "written as a pipeswap.models.base.LayeredModel of its layers"
    )


def _probing(
    run: Any, model: nn.Module, label: str, *, given: torch.Tensor | None, **kwargs: Any
) -> Any:
    """``run(model, **kwargs)``, whose ``example`` the model runs on; a model that fails on
    pipeswap's own probe is refused asking for an input of the user's."""
    try:
        return run(model, **kwargs)
    except PipeswapError:
        raise
    except Exception as error:
        shape = tuple(kwargs["example"].shape)
        if given is not None:
            raise PipeswapError(
                f"{label} does not run as model(example) on the example of shape {shape} "
                f"({type(error).__name__}: {first_line(error)}): pipeswap.adapt calls it with "
                "that one tensor; a forward that needs more arguments is wrapped in a "
                "module whose forward takes the one tensor and passes the rest"
            ) from error
        raise PipeswapError(
            f"{label} does not run on pipeswap's probe input of shape {shape} "
            f"({type(error).__name__}: {error}): pass example= (one batch of your inputs) to "
            "pipeswap.adapt, or give your model inputs of any length"
        ) from error


def _output_width(model: nn.Module, *, example: torch.Tensor) -> int:
    with inspecting(model):
        out = model(example)
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise PipeswapError(
            f"{type(model).__name__} returns {type(out).__name__} for images; an image "
            "classifier returns logits [batch, classes]"
        )
    return int(out.shape[1])


def _is_hf(model: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


# transformers' auto mappings whose classes pipeswap trains: the task, masked or not, and
# whether the model reads token ids (else images).
_HF_MAPPINGS = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "lm", False, True),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "lm", True, True),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "classify", False, True),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "classify", False, False),
)


def _hf_head(cls_name: str) -> tuple[str | None, bool, bool]:
    """(task, masked, reads tokens) of a Hugging Face class: where transformers' auto
    mappings list it (BertGenerationDecoder is a causal LM), else by its name's end."""
    auto: Any = importlib.import_module("transformers.models.auto.modeling_auto")
    for mapping, task, masked, tokens in _HF_MAPPINGS:
        for value in getattr(auto, mapping, {}).values():
            if cls_name in ((value,) if isinstance(value, str) else tuple(value)):
                return task, masked, tokens
    named = next((t for suffix, t in _HF_HEADS if cls_name.endswith(suffix)), None)
    return named, cls_name.endswith("ForMaskedLM"), not cls_name.endswith("ForImageClassification")


def _hf_info(model: nn.Module, name: str) -> dict[str, Any]:
    cls_name = type(model).__name__
    task, masked, tokens = _hf_head(cls_name)
    if task is None:
        heads = ", ".join(f"*{suffix}" for suffix, _ in _HF_HEADS)
        raise PipeswapError(f"{name}: {cls_name} has no head pipeswap trains; use a {heads} class")
    config: Any = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{name}: {cls_name} is an encoder-decoder model, which is not cut into one stack "
            "of layers: `pipeswap train` trains it data-parallel on source/target pairs "
            "({data} FILE with {source_field} and {target_field}), pipeswap.offload in your "
            "own loop; pipelines and `pipeswap profile` cut decoder-only and encoder-only models"
        )
    entry = task_kind(task)
    # A classifier reads what its class reads (BEiT's config has a vocabulary, for its
    # masked image modelling, and reads pixels); an image one's sizes are its vision
    # config's where it has one (CLIP, SigLIP).
    tokens = entry.takes_tokens or tokens
    info: dict[str, Any] = {"task": task, "masked": masked}
    info["takes_tokens"] = tokens
    if tokens:
        # Any vocabulary trains on the user's tokens; the built-in byte-level data checks
        # its own need (pipeswap.data.dataset_for).
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not isinstance(getattr(text, "vocab_size", None), int):
            raise PipeswapError(
                f"{name}: {cls_name}'s config has no vocab_size, and pipeswap needs the "
                "number of token ids the model takes: set config.vocab_size"
            )
        vocab = int(text.vocab_size)
        info["vocab_size"] = vocab
        info["max_positions"] = _max_positions(text)
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
    if not entry.per_position:  # one label per sample, of num_labels
        labels = int(getattr(config, "num_labels", 0))
        if labels < 2:
            raise PipeswapError(
                f"{name} has num_labels={labels}; pipeswap trains classifiers of 2 or more "
                "labels (cross-entropy): set num_labels in its config"
            )
        info["num_classes"] = labels
        vision = config if tokens else getattr(config, "vision_config", None) or config
        info["in_channels"] = int(getattr(vision, "num_channels", 3))
        size = getattr(vision, "image_size", None)
        info["image_size"] = int(size) if isinstance(size, int) else None
    return info


def _max_positions(config: Any) -> int | None:
    """The longest sequence the config allows; None where it sets none (XLNet's -1)."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
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
    if info["takes_tokens"]:
        length = min(_EXAMPLE_TOKENS, info["max_positions"] or _EXAMPLE_TOKENS)
        row = torch.arange(length, device=device)[None]
        # Two rows: a sequence classifier pools each row's last token (a batch of one
        # would hide a pooling that mixes rows up).
        example = torch.cat([row, row + 1]) % info["vocab_size"]
        layered = split_at_blocks(
            model,
            example=example,
            task=info["task"],
            name=name,
            blocks=blocks,
            input_name="input_ids",
            output_fn=_logits,
            call_kwargs=call_kwargs,
            run_context=_meta_safe_masks,
            vocab_size=info["vocab_size"],
            num_classes=info.get("num_classes", 0),
        )
        layered.mask_token_id = info["mask_token_id"]
        layered.takes_tokens = True
    else:
        size = info["image_size"] or _EXAMPLE_IMAGE
        example = torch.zeros(1, info["in_channels"], size, size, device=device)
        layered = split_at_blocks(
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
    # Imported by name: transformers is optional, and loaded already for a Hugging Face model.
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
