"""A user's model by name: ``module:function`` or a local Hugging Face directory, as a LayeredModel.

Loading only: what the name names is built here, then cut into layers by
pipeswap.models.adapt. Zoo names are built by pipeswap.models.registry.
"""

from __future__ import annotations

import importlib
import os
import stat
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeswap.errors import PipeswapError, first_line
from pipeswap.jsonio import load_json
from pipeswap.models.adapt import adapt
from pipeswap.models.base import LayeredModel
from pipeswap.models.fits import check_depth, check_fits, meta_build, parameter_count
from pipeswap.models.seeding import seeded
from pipeswap.progress import bars_shown, thread_lock_for_bars

__all__ = [
    "MAX_LABELS",
    "hf_directory_has_weights",
    "is_user_model",
    "names_user_model",
    "library_bars",
    "load_hf_model",
    "load_user_model",
    "same_model_directory",
]

# transformers expands a config's labels into a dict before any check of ours can run
# (10**8 of them exhaust the memory); ImageNet-21k has 21,843.
MAX_LABELS = 1_000_000
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def is_user_model(name: str) -> bool:
    """True for names ``load_user_model`` takes: ``module:function`` or an existing directory."""
    return ":" in name or os.path.isdir(name)


def names_user_model(name: str, zoo: Collection[str]) -> bool:
    """Whether ``name`` means the user's model rather than one of ``zoo``: a name
    :func:`is_user_model` takes, and a zoo name only where it is a directory holding a model
    (its config.json): the user's own directory ``gpt2-micro`` is theirs, never the zoo's."""
    if name in zoo:
        return os.path.isfile(os.path.join(name, "config.json"))
    return is_user_model(name)


def same_model_directory(a: str, b: str, zoo: Collection[str]) -> bool:
    """Whether the model names ``a`` and ``b`` are one directory of the user's written two
    ways (``./llama`` and ``/home/me/llama/``, a symlink): a run may be resumed or exported
    from another working directory."""
    return (
        a not in zoo
        and b not in zoo
        and os.path.isdir(a)
        and os.path.isdir(b)
        and os.path.samefile(a, b)
    )


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
        return adapt(_load_hf_directory(name, device, seed), name=name, blocks=blocks)
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
    if device.type != "meta" and any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise PipeswapError(
            f"{name} returned a model on the meta device (shapes, no values), which cannot "
            "train; build it with real tensors (pipeswap moves it to the device it trains on)"
        )
    return adapt(model, name=name, blocks=blocks)


def load_hf_model(
    directory: str, *, device: torch.device | str = "cpu", seed: int | None = 0
) -> nn.Module:
    """The Hugging Face model saved in ``directory`` as its own class (not cut into
    layers), loaded as :func:`load_user_model` loads one: offline, checked before it is
    built, seeded when the directory holds no weights."""
    return _load_hf_directory(directory, torch.device(device), seed)


def _import_module(module_name: str) -> Any:
    """The module, found on sys.path or, as `python -m` finds one, in the working
    directory (a console script's sys.path does not hold it)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        here = os.getcwd()
        if exc.name != top or here in sys.path:
            raise
        if not (
            os.path.isfile(os.path.join(here, top + ".py"))
            or os.path.isdir(os.path.join(here, top))
        ):
            raise
        sys.path.insert(0, here)
        return importlib.import_module(module_name)


def _import_function(name: str) -> Callable[[], Any]:
    module_name, _, attr = name.partition(":")
    try:
        function = getattr(_import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PipeswapError(
            f"cannot import {name!r} ({exc}); write module:function with the module in the "
            "working directory or on PYTHONPATH, e.g. my_models:build"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed as it ran (or parsed)
        raise PipeswapError(
            f"importing {module_name} for {name} failed ({first_line(exc)}); fix the module "
            "so that it imports"
        ) from None
    if not callable(function):
        raise PipeswapError(f"{name} is a {type(function).__name__}, not a function")
    return function


def _transformers() -> Any:
    try:
        # Here, not at the top: transformers is optional and slow to import.
        import transformers
    except ImportError:
        raise PipeswapError(
            "Hugging Face models need the transformers package: pip install 'pipeswap[hf]'"
        ) from None
    return transformers


@contextmanager
def library_bars(transformers: Any) -> Iterator[None]:
    """transformers' progress bars (loading weights) under our rule (pipeswap.progress),
    with the caller's own setting restored after."""
    hf_logging = transformers.utils.logging
    shown = hf_logging.is_progress_bar_enabled()
    thread_lock_for_bars()
    if bars_shown():
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()


def _refuse_special_files(directory: str) -> None:
    """Refuse a device, FIFO or socket in a model directory (through a link too) before
    transformers opens one and reads it without end or blocks."""
    for entry in os.scandir(directory):
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a broken link: transformers looks for its files by name
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise PipeswapError(
                f"{entry.path} is no regular file (a device, FIFO or socket), which would be "
                "read without end or block; a model directory holds regular files only"
            )


def _count_labels(config_path: Path, raw: dict[str, Any]) -> None:
    """Refuse more labels than MAX_LABELS before transformers expands them."""
    labels = raw.get("num_labels")
    names = raw.get("id2label")
    most = max(
        labels if isinstance(labels, int) else 0, len(names) if isinstance(names, dict) else 0
    )
    if most > MAX_LABELS:
        raise PipeswapError(
            f"{config_path} has {most:,} labels; pipeswap builds classifiers of at most "
            f"{MAX_LABELS:,}: lower num_labels (and id2label)"
        )


def _load_hf_directory(directory: str, device: torch.device, seed: int | None) -> nn.Module:
    config_path = Path(directory) / "config.json"
    _refuse_special_files(directory)
    if not config_path.is_file():
        raise PipeswapError(
            f"{directory} has no config.json; pass a directory written by a Hugging Face "
            "model's save_pretrained(), a zoo name, or module:function"
        )
    raw = load_json(config_path)  # bounded in size, finite numbers only
    _count_labels(config_path, raw)
    architectures = raw.get("architectures")
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
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        count = parameter_count(cls, config)
    except Exception as exc:  # noqa: BLE001 - any config transformers cannot build from
        raise PipeswapError(
            f"{config_path}: transformers cannot build {architectures[0]} from it "
            f"({first_line(exc)}); fix the config's fields (save_pretrained() writes a valid one)"
        ) from None
    check_depth(directory, config, count, torch.float32.itemsize)
    if device.type == "meta":
        return meta_build(cls, config).train()
    check_fits(directory, count, torch.float32.itemsize, device)
    if hf_directory_has_weights(directory):
        try:
            with library_bars(transformers):
                load = cls.from_pretrained
                model = load(directory, local_files_only=True, config=config, dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001 - damaged, truncated or mismatched weights
            raise PipeswapError(
                f"cannot load the weights in {directory} ({first_line(exc)}); the weight "
                "files are damaged or belong to another config: write them again with "
                "save_pretrained(), or remove them to start from random weights"
            ) from None
        model = model.to(device)
    else:
        with seeded(device, seed), device:
            model = cls(config)
    model.train()
    return model
