"""The trained model written back in the format it came in: a Hugging Face directory or safetensors."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from pipeswap.checkpoint import CheckpointConfig
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import dump_json, reason_of
from pipeswap.models.load import library_bars
from pipeswap.models.replay import Replay
from pipeswap.models.saved_dtype import cast_state, source_dtype, stamp_dtype

__all__ = [
    "MARKER",
    "SAVE_FORMAT",
    "check_save_target",
    "export_model",
    "export_trained",
    "load_saved",
    "replay_of",
    "source_module",
]

# Written beside the weights: marks a directory as a pipeswap save, which a later save may
# replace, and lists the files it wrote (only those are ever replaced or removed).
MARKER = "pipeswap-save.json"
SAVE_FORMAT = "pipeswap.save/1"
_NO_SAFETENSORS = "saving a model needs the safetensors package: pip install 'pipeswap[hf]'"
# Files a Hugging Face model directory keeps beside its weights (its tokenizer, its image
# processor), copied into the save: the saved directory preprocesses as the source did.
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
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",  # an image model's resizing and normalization
    "processor_config.json",
    "video_preprocessor_config.json",
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
    """The module a LayeredModel was adapted from (it shares its parameters), the one a
    wrapper holds (``wrapped``: an encoder-decoder's, pipeswap.models.seq2seq), or ``model``."""
    wrapped = getattr(model, "wrapped", None)
    if isinstance(wrapped, nn.Module):
        return wrapped
    replay = replay_of(model)
    return model if replay is None else replay.root


def check_save_target(directory: str, source: str, *, checkpoints: Sequence[str] = ()) -> None:
    """Refuse, before training, a save that would overwrite what the user wrote or that
    cannot be written: a file, the model's own directory, the run's ``checkpoints``
    directory, a non-empty directory that is no earlier pipeswap save (the run's checkpoint
    directories inside it aside), or a place this process may not write."""
    target = Path(directory)
    if target.exists() and not target.is_dir():
        raise PipeswapError(f"cannot save the model to {directory}: it is a file; name a directory")
    if os.path.isdir(source) and target.exists() and target.samefile(source):
        raise PipeswapError(
            f"cannot save the trained model over {directory}, the model it started from; "
            "name another directory"
        )
    for checkpoint in checkpoints:
        if os.path.realpath(checkpoint) == os.path.realpath(directory):
            raise PipeswapError(
                f"cannot save the model to {directory}: it is the run's checkpoint directory; "
                "name another directory (the checkpoint directory may lie inside it)"
            )
    if target.is_dir() and not (target / MARKER).is_file():
        try:
            foreign = sorted(e.name for e in target.iterdir() if not _holds(e, checkpoints))
        except OSError as exc:
            raise PipeswapError(
                f"cannot save the model to {directory}: {reason_of(exc)}; name another directory"
            ) from None
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise PipeswapError(
                f"cannot save the model to {directory}: it holds files pipeswap did not write "
                f"({shown}); name a new or empty directory, or an earlier save"
            )
    why = _unwritable(target)
    if why is not None:
        raise PipeswapError(f"cannot save the model to {directory}: {why}; name another directory")
    if importlib.util.find_spec("safetensors") is None:
        raise PipeswapError(_NO_SAFETENSORS)


def _holds(entry: Path, checkpoints: Sequence[str]) -> bool:
    """Whether ``entry`` is one of the run's checkpoint directories or a folder above one."""
    inside = os.path.realpath(entry) + os.sep
    return any((os.path.realpath(c) + os.sep).startswith(inside) for c in checkpoints)


def _unwritable(target: Path) -> str | None:
    """Why this process cannot create ``target`` or files in it; None when it can."""
    folder = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if os.access(folder, os.W_OK | os.X_OK):
        # os.access says yes to root everywhere: try it (/proc, a full or odd file system).
        try:
            fd, probe = tempfile.mkstemp(dir=folder, prefix=".pipeswap-probe-")
        except OSError as exc:
            return f"cannot create files in {folder} ({exc.strerror or exc})"
        os.close(fd)
        os.unlink(probe)
        return None
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return f"{folder} is on a read-only file system"
    except OSError:
        pass
    return f"permission denied in {folder}"


def export_trained(
    model: nn.Module, checkpoint: CheckpointConfig, *, source: str, steps: int
) -> None:
    """Write a run's trained model to ``checkpoint.save`` (nothing when it is None), falling
    back beside the run's checkpoints when that directory cannot be written."""
    if checkpoint.save is not None:
        export_model(
            model, checkpoint.save, source=source, steps=steps, checkpoints=checkpoint.directories
        )


def export_model(
    model: nn.Module, directory: str, *, source: str, steps: int, checkpoints: Sequence[str] = ()
) -> None:
    """Write ``model``'s weights to ``directory`` as they came in: a Hugging Face model
    through its ``save_pretrained`` (safetensors, plus the source directory's tokenizer
    files), any other module as ``model.safetensors`` of its own ``state_dict`` keys.

    Nothing pipeswap did not write is deleted or overwritten: the files are written
    inside the directory and each renamed into its place; an earlier save's files (the
    marker lists them) are replaced, those it no longer writes removed, and any other file
    kept. When the directory cannot be written (it became read-only, the disk filled, a
    file of the user's has a saved file's name), the model is written to a new folder in
    the first of ``checkpoints`` (the run's checkpoint directories), else in the system's
    temporary folder, and the error says where.
    """
    root = source_module(model)
    try:
        check_save_target(directory, source, checkpoints=checkpoints)
        _replace_save(root, Path(directory), source, steps)
        return
    except (OSError, PipeswapError) as exc:
        why = _why(exc)
    failures: list[str] = []
    for place in dict.fromkeys([*filter(os.path.isdir, checkpoints), tempfile.gettempdir()]):
        folder: Path | None = None
        try:
            folder = Path(tempfile.mkdtemp(prefix="pipeswap-saved-model-", dir=place))
            _write(root, folder, source)
            _mark(folder, source, steps, _names(folder))
        except (OSError, PipeswapError) as exc:
            failures.append(f"{place}: {_why(exc)}")
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)  # the folder this save made
            continue
        raise PipeswapError(
            f"cannot save the model to {directory} ({why}); it was written to {folder} "
            f"instead: move it to where it belongs"
        )
    last = (
        f"the run's last checkpoint is in {checkpoints[0]}: write the model from it with "
        "`pipeswap export`"
        if checkpoints
        else "free space, or save to another directory"
    )
    raise PipeswapError(
        f"cannot save the model to {directory} ({why}), nor anywhere else "
        f"({'; '.join(failures)}); {last}"
    )


def _why(exc: BaseException) -> str:
    """A failed write in a few words (an OSError's reason, else the error's message)."""
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    return reason_of(cause) if isinstance(cause, OSError) else str(exc)


def _replace_save(root: nn.Module, target: Path, source: str, steps: int) -> None:
    """Write the save into ``target`` file by file (temporary folder inside it, then one
    rename per file); the marker lists every file that may be pipeswap's at each moment."""
    created = not target.exists()
    target.mkdir(parents=True, exist_ok=True)
    marked = (target / MARKER).is_file()
    previous = _saved_files(target) if marked else set()
    staging: Path | None = None
    moved = False
    try:
        if not marked:  # from now on the directory is an (unfinished) save
            _mark(target, source, steps, [])
        staging = Path(tempfile.mkdtemp(prefix=".pipeswap-save-", dir=target))
        _write(root, staging, source)
        names = _names(staging)
        for name in names:  # refuse before any file moves
            place = target / name
            ours = previous is None or name in previous
            if (place.exists() or place.is_symlink()) and (not ours or place.is_dir()):
                raise PipeswapError(
                    f"{place} is not a file pipeswap wrote; move it away or name another directory"
                )
        _mark(target, source, steps, sorted((previous or set()) | set(names)))
        moved = True
        for name in names:
            os.replace(staging / name, target / name)
        for name in sorted((previous or set()) - set(names)):
            stale = target / name
            if stale.is_file() and not stale.is_symlink():
                stale.unlink()  # written by the earlier save, and no part of this one
        _mark(target, source, steps, names)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if not moved and not marked:
            # Failed before any file moved: leave the directory as it was (none if it was none).
            with contextlib.suppress(OSError):
                (target / MARKER).unlink(missing_ok=True)
                if created:
                    target.rmdir()


def _names(folder: Path) -> list[str]:
    """The names in ``folder``, the marker aside, sorted."""
    try:
        return sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    except OSError:
        return []


def _mark(folder: Path, source: str, steps: int, files: Sequence[str]) -> None:
    marker = {"format": SAVE_FORMAT, "model": source, "steps": steps, "files": list(files)}
    dump_json(folder / MARKER, marker)


def _saved_files(target: Path) -> set[str] | None:
    """The files the earlier save in ``target`` names as its own; None when its marker
    names none (an older pipeswap's, which replaced its directory whole)."""
    try:
        files = json.loads((target / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, list):
        return None
    return {f for f in files if isinstance(f, str) and _plain(f)}


def _plain(name: str) -> bool:
    """A file name directly in the directory: no separator, no ``..``, not the marker."""
    return name not in ("", ".", "..", MARKER) and not any(c in name for c in "/\\\0")


def _write(root: nn.Module, folder: Path, source: str) -> None:
    save_pretrained = getattr(root, "save_pretrained", None)
    if callable(save_pretrained):
        import transformers  # the model is one of its classes, so it is installed

        # Weights that came in a half precision go back in it (trained in float32).
        dtype = source_dtype(source)
        cast = {} if dtype is None else {"state_dict": cast_state(root, dtype)}
        with library_bars(transformers):
            save_pretrained(folder, safe_serialization=True, **cast)
        if dtype is not None:
            stamp_dtype(folder / "config.json", dtype)
        for name in _TOKENIZER_FILES:
            if os.path.isdir(source) and (Path(source) / name).is_file():
                shutil.copy2(Path(source) / name, folder / name)
        return
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise PipeswapError(_NO_SAFETENSORS) from None
    save_model(root, str(folder / "model.safetensors"))


def load_saved(directory: str) -> dict[str, torch.Tensor]:
    """The tensors :func:`export_model` wrote to ``directory``, by the model's own names
    (every safetensors shard; a tied weight once, as ``save_pretrained`` stores it)."""
    from safetensors.torch import load_file

    # The files the save lists (a file of the user's beside them is no part of the model).
    listed = _saved_files(Path(directory)) if (Path(directory) / MARKER).is_file() else None
    shards = sorted(
        Path(directory).glob("*.safetensors")
        if listed is None
        else (Path(directory) / name for name in listed if name.endswith(".safetensors"))
    )
    if not shards:
        raise PipeswapError(f"{directory} holds no safetensors files; it is no saved model")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    return state
