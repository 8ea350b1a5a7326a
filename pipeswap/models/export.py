"""The trained model written back in the format it came in: a Hugging Face directory or safetensors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.models.load import library_bars
from pipeswap.models.replay import Replay

# Written beside the weights: marks a directory as a pipeswap save, which a later save may replace.
MARKER = "pipeswap-save.json"
# Files a Hugging Face model directory keeps beside its weights, copied into the save.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


def replay_of(model: nn.Module) -> Replay | None:
    """The Replay of the layers of a LayeredModel split_at_blocks made, or of a stage of
    them (its last layer's; a stage's copy has its own), None for any other module."""
    for layer in reversed(list(model.children())):
        replay = getattr(layer, "replay", None)
        if isinstance(replay, Replay):
            return replay
    return None


def source_module(model: nn.Module) -> nn.Module:
    """The module a LayeredModel was adapted from (it shares its parameters), or ``model``."""
    replay = replay_of(model)
    return model if replay is None else replay.root


def check_save_target(directory: str, source: str) -> None:
    """Refuse, before training, a save that would overwrite what the user wrote: a file,
    the model's own directory, or a non-empty directory that is no earlier pipeswap save."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise PipeswapError(f"cannot save the model to {directory}: it is a file; name a directory")
    if os.path.isdir(source) and target.exists() and target.samefile(source):
        raise PipeswapError(
            f"cannot save the trained model over {directory}, the model it started from; "
            "name another directory"
        )
    if target.is_dir() and any(target.iterdir()) and not (target / MARKER).is_file():
        raise PipeswapError(
            f"cannot save the model to {directory}: it holds files pipeswap did not write; "
            "name a new or empty directory"
        )


def export_model(model: nn.Module, directory: str, *, source: str, steps: int) -> None:
    """Write ``model``'s weights to ``directory`` as they came in: a Hugging Face model
    through its ``save_pretrained`` (safetensors, plus the source directory's tokenizer
    files), any other module as ``model.safetensors`` of its own ``state_dict`` keys.

    The directory is written beside its final place and renamed into it, so a failure
    leaves the previous save (or nothing) in place.
    """
    check_save_target(directory, source)
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write(source_module(model), staging, source)
        (staging / MARKER).write_text(
            json.dumps({"format": "pipeswap.save/1", "model": source, "steps": steps}, indent=1)
        )
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / "previous")
        os.replace(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        raise PipeswapError(f"cannot save the model to {directory} ({exc})") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(root: nn.Module, folder: Path, source: str) -> None:
    save_pretrained = getattr(root, "save_pretrained", None)
    if callable(save_pretrained):
        import transformers  # the model is one of its classes, so it is installed

        with library_bars(transformers):
            save_pretrained(folder, safe_serialization=True)
        for name in _TOKENIZER_FILES:
            if os.path.isdir(source) and (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, folder / name)
        return
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise PipeswapError(
            "saving a model needs the safetensors package: pip install 'pipeswap[hf]'"
        ) from None
    save_model(root, str(folder / "model.safetensors"))


def load_saved(directory: str) -> dict[str, torch.Tensor]:
    """The tensors :func:`export_model` wrote to ``directory``, by the model's own names
    (every safetensors shard; a tied weight once, as ``save_pretrained`` stores it)."""
    from safetensors.torch import load_file

    shards = sorted(Path(directory).glob("*.safetensors"))
    if not shards:
        raise PipeswapError(f"{directory} holds no safetensors files; it is no saved model")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    return state
