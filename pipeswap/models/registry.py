"""Models by name: the zoo's ModelSpecs and builders, a user's model, ``build_model`` for any."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_format
from pipeswap.models.base import LayeredModel
from pipeswap.models.bert import BertConfig, build_bert
from pipeswap.models.gpt import GPTConfig, build_gpt
from pipeswap.models.load import load_user_model, names_user_model
from pipeswap.models.resnet import ResNetConfig, build_resnet
from pipeswap.models.seeding import seeded
from pipeswap.models.seq2seq import is_encoder_decoder, load_seq2seq, max_positions, stack_blocks
from pipeswap.models.tasks import Task, task_kind
from pipeswap.models.vgg import VGGConfig, build_vgg
from pipeswap.models.vit import ViTConfig, build_vit

__all__ = [
    "MODEL_SPEC_FORMAT",
    "ModelSpec",
    "build_model",
    "count_parameters",
    "model_names",
    "model_spec",
    "shape_defaults",
]

MODEL_SPEC_FORMAT = "pipeswap.modelspec/1"


@dataclass(frozen=True)
class ModelSpec:
    """What a model name builds (a zoo name, a Hugging Face directory or ``module:function``)
    and how it is usually trained.

    ``default_seq_len`` / ``max_seq_len`` are set for models of a task sized by ``seq_len``
    (language models: :attr:`task_entry`), ``default_image_size`` for image classifiers.
    ``published_params`` is the parameter count the model's paper or model card gives
    (None for our own test sizes).
    ``encoder_decoder``: a language model of two stacks (T5, BART: pipeswap.models.seq2seq),
    trained on source/target pairs, whose ``seq_len`` bounds the source and the target.
    """

    name: str
    family: str
    task: str
    default_batch: int
    default_seq_len: int | None
    default_image_size: int | None
    vocab_size: int
    num_classes: int
    published_params: int | None
    description: str
    max_seq_len: int | None = None
    encoder_decoder: bool = False
    # Whether the model reads token ids, where its task's entry does not say it (a user's
    # BertForSequenceClassification: a classifier whose task's models read images).
    reads_tokens: bool | None = None

    @property
    def task_entry(self) -> Task:
        """The entry of :attr:`task` in the task table (pipeswap.models.tasks)."""
        return task_kind(self.task)

    def to_json(self) -> dict[str, Any]:
        return {"format": MODEL_SPEC_FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ModelSpec:
        check_format(obj, MODEL_SPEC_FORMAT, where="model spec")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})


# A builder takes (tie_embeddings, image_size, init) and returns the model.
_Builder = Callable[[bool, int | None, bool], LayeredModel]
_ZOO: dict[str, tuple[ModelSpec, _Builder]] = {}


def _gpt(
    name: str, config: GPTConfig, batch: int, seq: int, published: int | None, about: str
) -> None:
    spec = ModelSpec(
        name, "gpt", "lm", batch, seq, None, config.vocab_size, 0, published, about, config.context
    )
    _ZOO[name] = (
        spec,
        lambda tie, _size, init: build_gpt(name, config, tie_embeddings=tie, init=init),
    )


def _bert(
    name: str, config: BertConfig, batch: int, seq: int, published: int | None, about: str
) -> None:
    spec = ModelSpec(
        name,
        "bert",
        "lm",
        batch,
        seq,
        None,
        config.vocab_size,
        0,
        published,
        about,
        config.max_positions,
    )
    _ZOO[name] = (
        spec,
        lambda tie, _size, init: build_bert(name, config, tie_embeddings=tie, init=init),
    )


def _image(
    name: str,
    family: str,
    config: ResNetConfig | VGGConfig | ViTConfig,
    batch: int,
    size: int,
    published: int | None,
    about: str,
) -> None:
    spec = ModelSpec(
        name, family, "classify", batch, None, size, 0, config.num_classes, published, about
    )

    def build(_tie: bool, image_size: int | None, init: bool) -> LayeredModel:
        if isinstance(config, ResNetConfig):
            return build_resnet(name, config, init=init)
        if isinstance(config, VGGConfig):
            return build_vgg(name, config, init=init)
        vit = (
            config
            if image_size is None
            else ViTConfig(**{**asdict(config), "image_size": image_size})
        )
        return build_vit(name, vit, init=init)

    _ZOO[name] = (spec, build)


# fmt: off
_BYTES = 256
_WORDPIECE = 30522
_BPE = 50257
_gpt("gpt2-micro", GPTConfig(_BYTES, 64, 32, 2, 2), 4, 32, None, "test size: 2 blocks, hidden 32, bytes")
_gpt("gpt2-tiny", GPTConfig(_BYTES, 256, 64, 4, 4), 8, 128, None, "4 blocks, hidden 64, byte vocabulary")
_gpt("gpt2-small", GPTConfig(_BPE, 1024, 768, 12, 12), 8, 1024, 124_000_000, "GPT-2 124M (Radford et al. 2019, corrected counts)")
_gpt("gpt2-medium", GPTConfig(_BPE, 1024, 1024, 24, 16), 8, 1024, 355_000_000, "GPT-2 355M")
_gpt("gpt2-large", GPTConfig(_BPE, 1024, 1280, 36, 20), 4, 1024, 774_000_000, "GPT-2 774M")
_gpt("gpt2-xl", GPTConfig(_BPE, 1024, 1600, 48, 25), 4, 1024, 1_558_000_000, "GPT-2 1.5B")
_bert("bert-micro", BertConfig(_BYTES, 64, 32, 2, 2, 128), 4, 32, None, "test size: 2 layers, hidden 32, bytes")
_bert("bert-tiny", BertConfig(_BYTES, 512, 128, 2, 2, 512), 32, 128, None, "BERT-Tiny shape (L=2, H=128) with a byte vocabulary")
_bert("bert-base", BertConfig(_WORDPIECE, 512, 768, 12, 12, 3072), 32, 512, 110_000_000, "BERT-base 110M (Devlin et al. 2019)")
_bert("bert-large", BertConfig(_WORDPIECE, 512, 1024, 24, 16, 4096), 32, 512, 336_000_000, "BERT-large 336M as counted by Megatron-LM (Devlin et al. round to 340M)")
_image("resnet-micro", "resnet", ResNetConfig(False, (2, 2), (8, 16), 10, stem_width=8, small_stem=True), 8, 32, None, "test size: 4 basic blocks, widths 8-16")
_image("resnet18", "resnet", ResNetConfig(False, (2, 2, 2, 2), (64, 128, 256, 512), 1000), 128, 224, 11_700_000, "ResNet-18 (He et al. 2016)")
_image("resnet50", "resnet", ResNetConfig(True, (3, 4, 6, 3), (64, 128, 256, 512), 1000), 64, 224, 25_600_000, "ResNet-50, bottleneck v1.5")
_image("resnet101", "resnet", ResNetConfig(True, (3, 4, 23, 3), (64, 128, 256, 512), 1000), 64, 224, 44_500_000, "ResNet-101, bottleneck v1.5")
_image("resnet152", "resnet", ResNetConfig(True, (3, 8, 36, 3), (64, 128, 256, 512), 1000), 64, 224, 60_200_000, "ResNet-152, bottleneck v1.5")
_image("vgg-micro", "vgg", VGGConfig(((8,), (16,), (32,)), 32, 10, pooled=1), 8, 32, None, "test size: 3 convolutions, 3 linear layers")
_image("vgg16", "vgg", VGGConfig(((64,) * 2, (128,) * 2, (256,) * 3, (512,) * 3, (512,) * 3), 4096, 1000), 64, 224, 138_000_000, "VGG-16 (Simonyan & Zisserman 2015), no dropout")
_image("vit-micro", "vit", ViTConfig(32, 8, 32, 2, 2, 64, 10), 8, 32, None, "test size: 2 blocks, hidden 32, patch 8")
_image("vit-tiny", "vit", ViTConfig(224, 16, 192, 12, 3, 768, 1000), 64, 224, 5_700_000, "ViT-Ti/16 (DeiT, Touvron et al. 2021)")
_image("vit-b16", "vit", ViTConfig(224, 16, 768, 12, 12, 3072, 1000), 64, 224, 86_600_000, "ViT-B/16 (Dosovitskiy et al. 2021)")
_image("vit-l16", "vit", ViTConfig(224, 16, 1024, 24, 16, 4096, 1000), 64, 224, 304_000_000, "ViT-L/16")
# fmt: on


def model_names() -> list[str]:
    """Every zoo name, in zoo order (family by family, small to large); ``build_model`` also
    takes a local Hugging Face directory or ``module:function``."""
    return list(_ZOO)


def _entry(name: str) -> tuple[ModelSpec, _Builder]:
    if name in _ZOO:
        return _ZOO[name]
    if os.path.exists(name):  # a file: not a model path, though it looks like one
        stem = Path(name).stem
        raise PipeswapError(
            f"{name} is a file; a model is a zoo name, a Hugging Face model directory (its "
            "config.json and weights, as save_pretrained() writes them) or module:function "
            f"(for a Python file, put its folder on PYTHONPATH and write {stem}:FUNCTION)"
        )
    if "/" in name or os.sep in name or name.startswith((".", "~")):  # meant as a path
        raise PipeswapError(
            f"there is no model directory {name} (nothing exists at that path); give the "
            "directory save_pretrained() wrote (its config.json and weights), or a zoo name"
        )
    close = difflib.get_close_matches(name.lower(), list(_ZOO), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise PipeswapError(
        f"unknown model {name!r}{hint} Known models: {', '.join(_ZOO)}; or pass a local "
        "Hugging Face model directory, or module:function returning an nn.Module"
    )


def model_spec(name: str) -> ModelSpec:
    """The ModelSpec of a zoo name, a Hugging Face directory or ``module:function``.

    For a user's model it is read off the model built on the meta device: no published
    count, a default batch of 8, a default sequence length of min(128, its context) for
    a language model that states its context, its image size (ViT) or 32 for images.
    """
    if names_user_model(name, _ZOO):
        return _user_spec(name)
    return _entry(name)[0]


@functools.lru_cache(maxsize=16)
def _user_spec(name: str) -> ModelSpec:
    if is_encoder_decoder(name):
        return _encoder_decoder_spec(name)
    model = load_user_model(name, device="meta")
    lm = model.task_entry.has_seq_len
    context = model.max_positions
    return ModelSpec(
        name=name,
        family="user",
        task=model.task,
        default_batch=8,
        default_seq_len=(min(128, context) if context else None) if lm else None,
        default_image_size=None if lm else (model.fixed_image_size or 32),
        vocab_size=model.vocab_size,
        num_classes=model.num_classes,
        published_params=None,
        description=f"your model ({len(model)} layers: {', '.join(model.layer_names[:3])}...)",
        max_seq_len=context,
        reads_tokens=model.takes_tokens,
    )


def _encoder_decoder_spec(name: str) -> ModelSpec:
    model = load_seq2seq(name, device="meta")
    context = max_positions(model)
    blocks = stack_blocks(model.model)
    return ModelSpec(
        name=name,
        family="user",
        task="lm",
        default_batch=8,
        default_seq_len=min(128, context) if context else 128,
        default_image_size=None,
        vocab_size=model.vocab_size,
        num_classes=0,
        published_params=None,
        description=f"your encoder-decoder ({len(blocks)} blocks: {', '.join(blocks[:2])}...)",
        max_seq_len=context,
        encoder_decoder=True,
    )


def shape_defaults(
    model_name: str, seq_len: int | None, image_size: int | None
) -> tuple[int | None, int | None]:
    """(seq_len, image_size) for a model: the given one, else the model's default.

    A sequence longer than the model's context, or a language model with no default and
    no ``seq_len``, is refused naming the setting to pass (a ConfigError).
    """
    spec = model_spec(model_name)
    if spec.task_entry.has_seq_len:
        chosen = seq_len or spec.default_seq_len
        longest = spec.max_seq_len
        if chosen is None:
            most = f" (at most {longest})" if longest else ""
            raise ConfigError(
                f"{model_name} is {spec.task_entry.noun} with no default sequence length: pass "
                f"{{seq_len}} N{most}"
            )
        if longest is not None and chosen > longest:
            raise ConfigError(
                f"{{seq_len}} {chosen} exceeds this model's context ({model_name}: {longest} "
                f"tokens); pass {{seq_len}} {longest} or less"
            )
        return chosen, None
    return None, image_size or spec.default_image_size


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (a tied matrix counts once)."""
    return sum(p.numel() for p in model.parameters())


def build_model(
    name: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tie_embeddings: bool | None = None,
    image_size: int | None = None,
    seed: int | None = 0,
) -> LayeredModel:
    """Build the model ``name`` names directly on ``device`` with parameters of ``dtype``.

    ``name`` is a zoo name, a local Hugging Face directory or ``module:function``
    (pipeswap.models.load). On ``"meta"`` no memory is allocated and no initialisation
    runs (fast for any size). Elsewhere the weights are a deterministic function of
    ``seed`` (None: the global RNG), drawn in float32 and rounded to ``dtype``.
    ``tie_embeddings`` (language models; default True) shares the output projection with
    the token embedding; pipelines pass False so each stage owns its weights.
    ``image_size`` (image models) sizes ViT's position embeddings; ResNet and VGG pool
    adaptively, ignore it, and take any image of at least 32x32.
    """
    device = torch.device(device)
    if not dtype.is_floating_point:
        raise ConfigError(f"{{dtype}} must be a floating-point type such as float32, not {dtype}")
    if names_user_model(name, _ZOO):
        model = load_user_model(name, device=device, seed=seed)
        if tie_embeddings is False:
            raise PipeswapError(f"{name} is your model: pipeswap does not untie its weights")
        fixed = model.fixed_image_size
        if image_size is not None and fixed is not None and image_size != fixed:
            raise ConfigError(
                f"{name} takes {fixed}x{fixed} images (its config's image_size); pass "
                f"{{image_size}} {fixed}"
            )
        return model.to(dtype=dtype)
    spec, builder = _entry(name)
    if tie_embeddings is not None and not spec.task_entry.takes_tokens:
        raise PipeswapError(f"{name} has no token embeddings to tie; leave tie_embeddings unset")
    if image_size is not None and (not spec.task_entry.has_image_size or image_size < 1):
        raise ConfigError(
            f"{{image_size}}={image_size} does not apply to {name}: pass a positive "
            "{image_size} to image models only"
        )
    tie = True if tie_embeddings is None else tie_embeddings
    init = device.type != "meta"
    with seeded(device, seed), device:
        model = builder(tie, image_size, init)
    # Initialising in float32 and converting makes the weights the same (up to rounding)
    # whatever the dtype; .to() keeps tied parameters tied.
    return model.to(dtype=dtype)
