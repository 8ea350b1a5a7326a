"""A user's data files, opened safely: regular files only, text read with a bound, no pickles.

A data path that is a device (``/dev/zero``, through a symlink too), a FIFO or a socket
would be read without end or block in ``open``; each is refused before a byte is read:
paths are checked with ``stat`` (which never blocks) and opened with ``O_NONBLOCK``, then
checked again on the open descriptor, so a file swapped for a FIFO in between is refused
too. Text is read whole into memory, so at most :data:`MAX_TEXT_BYTES` of it (larger
corpora are tokenized once into a memory-mapped ``.bin``). Invalid UTF-8 is replaced and
counted; a file more than :data:`MAX_NOT_TEXT` not text is refused. A ``.npy`` header is
parsed as a literal (numpy's own parser), and only integer arrays are memory-mapped: a
data file can never make pipeswap import, call or delete anything.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipeswap.config_fields import ConfigError
from pipeswap.units import format_bytes

__all__ = [
    "MAX_NOT_TEXT",
    "MAX_TEXT_BYTES",
    "TextStats",
    "check_tree",
    "fingerprint",
    "map_npy",
    "open_regular",
    "read_text",
    "require_regular",
]

# Text (and tables of text) is tokenized in memory, about 10 bytes per byte of text with
# a tokenizer's token lists; beyond this, write tokens to a .bin (memory-mapped, any size).
MAX_TEXT_BYTES = 1 << 30
# The fraction of a text file's bytes that may be no text (invalid UTF-8, control bytes
# other than whitespace); above it the file is refused as binary (random bytes: ~0.55).
MAX_NOT_TEXT = 0.25
_CONTROL = np.zeros(256, dtype=bool)  # control bytes, whitespace (tab to CR) aside
_CONTROL[[*range(0x00, 0x09), *range(0x0E, 0x20), 0x7F]] = True
_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes surrogateescape kept: invalid UTF-8
_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(path: str | Path, mode: int) -> ConfigError:
    if stat.S_ISDIR(mode):
        return ConfigError(f"{{data}} {path} is a directory where a file was expected; give a file")
    kind = next((name for test, name in _KINDS if test(mode)), "no regular file")
    link = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return ConfigError(
        f"{{data}} {path}{link} is {kind}, which would be read without end or block; "
        "pipeswap reads data from regular files only: give a file (or a folder of files)"
    )


def require_regular(path: str | Path) -> os.stat_result:
    """``path``'s stat, refused unless it is a regular file (``stat`` never blocks)."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{{data}} {path} does not exist (a broken link?); give a file") from None
    except OSError as exc:
        raise ConfigError(f"{{data}} cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(found.st_mode):
        raise _not_regular(path, found.st_mode)
    return found


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` open for binary reading; only a regular file, checked on the descriptor."""
    require_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{{data}} cannot read {path}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # swapped after the check above
        os.close(fd)
        raise _not_regular(path, mode)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def check_tree(folder: str | Path, files: list[Path] | None = None) -> None:
    """Refuse a device, FIFO or socket among ``files`` (default: everything under
    ``folder``) before anything under it is opened."""
    for file in files if files is not None else Path(folder).rglob("*"):
        if not file.is_dir():
            require_regular(file)


@dataclass
class TextStats:
    """What reading text found: bytes read and invalid UTF-8 bytes replaced, over files."""

    read: int = 0
    replaced: int = 0
    files: int = 0

    def note(self) -> str | None:
        """A sentence on the replaced bytes, or None when every byte was UTF-8."""
        if not self.replaced:
            return None
        where = f" in {self.files} files" if self.files > 1 else ""
        return (
            f"{self.replaced:,} of {self.read:,} bytes{where} are not UTF-8 and were replaced "
            "by U+FFFD; save the text as UTF-8 to train on what it says"
        )

    def count(self, size: int, where: str | Path) -> None:
        """Add ``size`` bytes of text from ``where``, refusing more than MAX_TEXT_BYTES."""
        self.read += size
        if self.read > MAX_TEXT_BYTES:
            raise ConfigError(
                f"{{data}} {where}: more than {format_bytes(MAX_TEXT_BYTES)} of text, which "
                "pipeswap would tokenize in memory; tokenize a larger corpus once into a "
                ".bin file of uint16 tokens (memory-mapped, read in constant memory)"
            )


def read_text(path: str | Path, stats: TextStats) -> str:
    """A text file as a string, read with the bound of ``stats``; invalid UTF-8 replaced
    and counted, a file more than MAX_NOT_TEXT no text refused."""
    with open_regular(path) as handle:
        raw = handle.read(MAX_TEXT_BYTES - stats.read + 1)
    stats.count(len(raw), path)
    try:
        text = raw.decode("utf-8")
        escaped = 0
    except UnicodeDecodeError:
        text = raw.decode("utf-8", "surrogateescape")  # one lone surrogate per bad byte
        text, escaped = _ESCAPED.subn("\ufffd", text)
    # ASCII control bytes are never part of an invalid sequence: the two counts are disjoint.
    bad = escaped + int(np.count_nonzero(_CONTROL[np.frombuffer(raw, dtype=np.uint8)]))
    if raw and bad > MAX_NOT_TEXT * len(raw):
        raise ConfigError(
            f"{{data}} {path} is not text: {bad:,} of its {len(raw):,} bytes are invalid "
            "UTF-8 or control bytes; give UTF-8 text, or tokens as .bin (uint16) or .npy"
        )
    stats.replaced += escaped
    stats.files += 1
    return text


def map_npy(path: str) -> np.ndarray:
    """The 1-D integer array of a ``.npy`` file, memory-mapped; anything else refused
    (a pickle or object array is never loaded)."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        try:
            version = np.lib.format.read_magic(handle)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }[version]
            shape, fortran, dtype = read_header(handle)
        except (ValueError, KeyError, SyntaxError, EOFError) as exc:
            raise ConfigError(
                f"{{data}} {path} is no .npy array numpy.save writes ({exc}); give a 1-D "
                "integer array saved with numpy.save, or uint16 tokens as .bin"
            ) from None
        offset = handle.tell()
    if len(shape) != 1 or not np.issubdtype(dtype, np.integer):
        raise ConfigError(
            f"{{data}} {path}: a {dtype} array of shape {shape}; write a 1-D array of "
            "integer token ids"
        )
    needed = offset + shape[0] * dtype.itemsize
    if size < needed:
        raise ConfigError(
            f"{{data}} {path} is {size:,} bytes, but its header promises {shape[0]:,} "
            f"{dtype} tokens ({needed:,} bytes): the file is truncated; save it again"
        )
    del fortran  # a 1-D array is the same in either order
    if shape[0] == 0:
        return np.zeros(0, dtype=dtype)  # mmap refuses an empty map; no tokens either way
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(shape[0],))


# A fingerprint reads this much of each end of a file: a changed file is seen without
# reading a corpus of any size whole (its size and both ends).
_FINGERPRINT_BYTES = 1 << 20


def fingerprint(path: str | Path) -> str:
    """What a run read, as a checkpoint records it: each regular file's size and a digest
    of its first and last MiB (a folder: its files, by name). A resume compares it."""
    import hashlib

    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    digest = hashlib.sha256()
    total = 0
    for file in files:
        size = require_regular(file).st_size
        total += size
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}:{size};".encode())
        with open_regular(file) as handle:
            digest.update(handle.read(_FINGERPRINT_BYTES))
            if size > _FINGERPRINT_BYTES:
                handle.seek(max(_FINGERPRINT_BYTES, size - _FINGERPRINT_BYTES))
                digest.update(handle.read(_FINGERPRINT_BYTES))
    return f"{root.name}: {len(files)} file(s), {format_bytes(total)}, {digest.hexdigest()[:12]}"
