"""pipeswap/user_files.py: data that never ends, blocks, is no text or holds a pickle is refused.

Every refusal here must come at once: a test that would block (a FIFO opened for
reading) is cut off by SIGALRM after a few seconds and fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeswap import user_files
from pipeswap.cli import main
from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.user_data import TextDataset, read_tokens
from pipeswap.user_files import MAX_NOT_TEXT, TextStats, open_regular, read_text
from pipeswap.user_images import ImageFolderDataset

TRAIN = ["train", "--model", "gpt2-micro", "--batch", "2", "--seq-len", "8", "--steps", "1"]


@contextlib.contextmanager
def _within(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging when the block takes longer than ``seconds``:
    SIGALRM interrupts even a blocking open()."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds} s: it blocked")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("suffix", [".txt", ".bin", ".npy", ".jsonl", ".csv"])
def test_a_device_through_a_symlink_is_refused_before_a_byte_is_read(
    tmp_path: Path, suffix: str
) -> None:
    # Before: a .txt linked to /dev/zero was read until the memory cgroup killed the run.
    path = tmp_path / f"zero{suffix}"
    path.symlink_to("/dev/zero")
    started = time.perf_counter()
    with _within(10), pytest.raises(ConfigError) as refused:
        read_tokens(str(path), "text", None)
    assert time.perf_counter() - started < 2
    assert f"data {path} (a link to /dev/zero) is a character device" in str(refused.value)
    assert "regular files only" in str(refused.value)


@pytest.mark.parametrize("suffix", [".txt", ".bin", ".npy", ".jsonl", ".parquet"])
def test_a_fifo_as_data_is_refused_without_blocking(tmp_path: Path, suffix: str) -> None:
    # Before: open() of a FIFO waited forever for a writer.
    fifo = tmp_path / f"pipe{suffix}"
    os.mkfifo(fifo)
    with _within(10), pytest.raises(ConfigError, match=r"pipe\.\w+ is a FIFO \(named pipe\)"):
        read_tokens(str(fifo), "text", None)


def test_a_fifo_inside_a_data_folder_is_refused_before_any_file_is_read(tmp_path: Path) -> None:
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("some text " * 50)
    os.mkfifo(folder / "sub" / "b.txt")
    with _within(10), pytest.raises(ConfigError, match=r"sub/b\.txt is a FIFO"):
        read_tokens(str(folder), "text", None)
    # A saved dataset's files are opened by datasets: checked first too.
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    os.mkfifo(saved / "data-00000-of-00001.arrow")
    with _within(10), pytest.raises(ConfigError, match=r"data-00000-of-00001\.arrow is a FIFO"):
        read_tokens(str(saved), "text", None)
    # So are an image folder's files.
    images = tmp_path / "images"
    for name in ("cat", "dog"):
        (images / name).mkdir(parents=True)
    os.mkfifo(images / "dog" / "x.png")
    (images / "cat" / "y.png").symlink_to("/dev/zero")
    with _within(10), pytest.raises(ConfigError, match=r"y\.png \(a link to /dev/zero\)"):
        ImageFolderDataset(str(images), 16, num_classes=2)


def test_a_file_swapped_for_a_fifo_after_the_check_is_refused_on_its_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "late.txt"
    os.mkfifo(fifo)
    monkeypatch.setattr(user_files, "require_regular", lambda path: None)  # the race
    with _within(10), pytest.raises(ConfigError, match="late.txt is a FIFO"):
        open_regular(fifo)


def test_the_cli_refuses_a_fifo_and_a_device_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    for name in ("pipe.txt", "zero.txt"):
        with _within(30):
            assert main([*TRAIN, "--data", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert f"--data {tmp_path / name}" in err and "regular files only" in err


def test_text_is_read_up_to_a_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(user_files, "MAX_TEXT_BYTES", 100)
    (tmp_path / "a.txt").write_text("x" * 60)
    (tmp_path / "b.txt").write_text("y" * 60)
    stats = TextStats()
    assert read_text(tmp_path / "a.txt", stats) == "x" * 60
    with pytest.raises(ConfigError, match=r"b.txt: more than 100 B of text, .* \.bin file"):
        read_text(tmp_path / "b.txt", stats)  # the bound holds over a folder's files
    with pytest.raises(ConfigError, match="more than 100 B of text"):
        read_tokens(str(tmp_path), "text", None)


def test_invalid_utf8_is_counted_and_text_that_is_mostly_bytes_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait. ".encode("latin-1") * 100)  # 1 of 14 bytes invalid
    with pytest.warns(UnicodeWarning, match=r"latin.txt: 100 of 1,400 bytes are not UTF-8"):
        tokens = read_tokens(str(latin), "text", None)
    assert bytes(np.asarray(tokens[:6], dtype=np.uint8)) == "caf\ufffd".encode()
    clean = tmp_path / "clean.txt"
    clean.write_text("caf\u00e9 au lait. " * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # valid UTF-8: not a word
        read_tokens(str(clean), "text", None)
    # Before: 50 KB of random bytes trained with exit 0.
    noise = tmp_path / "noise.txt"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes())
    with pytest.raises(ConfigError, match=r"noise.txt is not text: [\d,]+ of its 50,000 bytes"):
        read_tokens(str(noise), "text", None)
    assert main([*TRAIN, "--data", str(noise)]) == 2
    assert "give UTF-8 text, or tokens as .bin (uint16) or .npy" in capsys.readouterr().err
    # UTF-16 (half its bytes NUL) is no UTF-8 text either; a little binary is tolerated.
    (tmp_path / "wide.txt").write_bytes(("plain words " * 100).encode("utf-16-le"))
    with pytest.raises(ConfigError, match="wide.txt is not text"):
        read_tokens(str(tmp_path / "wide.txt"), "text", None)
    some = tmp_path / "some.txt"
    some.write_bytes(b"\x00" * int(MAX_NOT_TEXT * 1000) + b"a" * (1000 - int(MAX_NOT_TEXT * 1000)))
    assert len(read_tokens(str(some), "text", None)) == 1000


class _Marker:
    """Unpickling this would call os.mkdir: what a hostile .npy would make numpy do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def test_a_npy_is_read_as_a_literal_integer_array_never_a_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "called"
    pickled = tmp_path / "pickled.npy"
    pickled.write_bytes(pickle.dumps(_Marker(marker)))
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([_Marker(marker), 1], dtype=object), allow_pickle=True)
    garbage = tmp_path / "garbage.npy"
    garbage.write_bytes(np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8).tobytes())
    truncated = tmp_path / "truncated.npy"
    np.save(truncated, np.arange(1000, dtype=np.int32))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    for path, message in (
        (pickled, "pickled.npy is no .npy array numpy.save writes"),
        (garbage, "garbage.npy is no .npy array numpy.save writes"),
        (objects, "objects.npy: a object array of shape (2,); write a 1-D array of integer"),
        (truncated, "truncated.npy is 4,028 bytes, but its header promises 1,000 int32 tokens"),
    ):
        with pytest.raises(ConfigError) as refused:
            read_tokens(str(path), "text", None)
        assert message in str(refused.value)
        # Before: exit 1, passing on numpy's advice to allow_pickle.
        assert main([*TRAIN, "--data", str(path)]) == 2
        err = capsys.readouterr().err
        assert "allow_pickle" not in err and "Traceback" not in err
    assert not marker.exists()
    good = tmp_path / "good.npy"
    np.save(good, np.arange(100, dtype=">i4") % 250)  # big-endian is fine
    tokens = read_tokens(str(good), "text", None)
    assert isinstance(tokens, np.memmap) and np.array_equal(tokens, np.arange(100) % 250)


def test_a_token_file_that_changes_during_a_run_is_refused_not_trained_on(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.bin"
    (np.arange(17 * 20) % 200).astype(np.uint16).tofile(path)
    data = TextDataset(read_tokens(str(path), "text", None), 16, vocab_size=256, where=str(path))
    data.batch(4, 0)
    # Replaced in place by tokens outside the vocabulary (the loss would turn NaN).
    path.write_bytes(np.full(17 * 20, 60000, dtype=np.uint16).tobytes())
    with pytest.raises(PipeswapError, match="changed while pipeswap read it: it now holds tokens"):
        data.batch(4, 0)
    # Shrunk: a short read.
    path.write_bytes(b"")
    with pytest.raises(
        PipeswapError, match=r"t.bin changed while pipeswap read it: it is 0 bytes now"
    ):
        data.batch(4, 0)
    # Replaced by a FIFO: refused, not waited on.
    path.unlink()
    os.mkfifo(path)
    with _within(10), pytest.raises(ConfigError, match="t.bin is a FIFO"):
        data.batch(4, 0)
