"""Tests of pipeswap/jsonio.py writes: symlinks, permission bits, OSErrors as PipeswapError,
and check_writable."""

import errno
import os
import stat
from pathlib import Path

import pytest

from pipeswap import jsonio
from pipeswap.errors import PipeswapError
from pipeswap.jsonio import check_writable, write_atomic

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def _temporaries(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if name.endswith(".tmp")]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_symlinked_output_rewrites_the_target_and_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "data" / "real.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"
    assert _temporaries(tmp_path) == [] and _temporaries(real.parent) == []


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "later.json")
    write_atomic(link, "x")
    assert link.is_symlink() and (tmp_path / "later.json").read_text() == "x"


def test_a_symlink_loop_is_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(PipeswapError, match="symlink loop"):
        write_atomic(a, "x")
    assert a.is_symlink() and b.is_symlink()


def test_an_existing_file_keeps_its_permission_bits(tmp_path: Path) -> None:
    target = tmp_path / "shared.json"
    target.write_text("old")
    target.chmod(0o644)
    write_atomic(target, "new")
    assert _mode(target) == 0o644
    target.chmod(0o600)
    write_atomic(target, "newer")
    assert _mode(target) == 0o600 and target.read_text() == "newer"


def test_a_new_file_gets_the_umask_mode_not_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.json", "x")
        os.umask(0o002)
        write_atomic(tmp_path / "b.json", "x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "a.json") == 0o644
    assert _mode(tmp_path / "b.json") == 0o664


def test_a_directory_as_path_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(PipeswapError, match=r"out is a directory; give a file name"):
        write_atomic(folder, "x")
    assert os.listdir(folder) == [] and _temporaries(tmp_path) == []


@pytest.mark.parametrize("name", ["f/x.json", "f/deeper/x.json"])
def test_a_file_in_place_of_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "f").write_text("keep")
    with pytest.raises(PipeswapError, match=r"cannot write .*x\.json: .*f is a file, not a folder"):
        write_atomic(tmp_path / name, "x")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.skipif(IS_ROOT, reason="root ignores directory permissions")
def test_a_read_only_folder_is_refused_and_the_old_file_kept(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "p.json").write_text("old")
    folder.chmod(0o500)
    try:
        with pytest.raises(PipeswapError, match="p.json: permission denied; choose another path"):
            write_atomic(folder / "p.json", "new")
        with pytest.raises(PipeswapError, match="permission denied"):
            check_writable(folder / "p.json")
    finally:
        folder.chmod(0o700)
    assert (folder / "p.json").read_text() == "old" and _temporaries(folder) == []


@pytest.mark.parametrize(
    ("patched", "code", "message"),
    [
        ("replace", errno.EROFS, "read-only file system; choose another path"),
        ("replace", errno.EACCES, "permission denied; choose another path"),
        ("fsync", errno.ENOSPC, "the disk is full; free space or choose another path"),
        ("fsync", errno.EIO, "Input/output error; choose another path"),
    ],
)
def test_os_errors_become_advice_and_keep_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patched: str, code: int, message: str
) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")

    def fail(*args: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, patched, fail)
    with pytest.raises(PipeswapError, match=rf"cannot write {target}: {message}"):
        write_atomic(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]


def test_an_interrupted_write_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupt(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "p.json", "x")
    assert os.listdir(tmp_path) == []


def test_check_writable_accepts_new_and_existing_files(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text("x")
    check_writable(tmp_path / "old.json")
    check_writable(tmp_path / "new" / "deeper" / "p.json", inputs=[None], outputs=[None])
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_check_writable_refuses_bad_paths(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(PipeswapError, match="is a directory; give a file name"):
        check_writable(tmp_path)
    with pytest.raises(PipeswapError, match=r"f is a file, not a folder"):
        check_writable(tmp_path / "f" / "sub" / "p.json")


def test_check_writable_refuses_an_output_that_is_an_input(tmp_path: Path) -> None:
    graph = tmp_path / "graph.json"
    graph.write_text("{}")
    with pytest.raises(PipeswapError, match="graph.json is also an input; write to another file"):
        check_writable(graph, inputs=[tmp_path / "other.json", graph])
    # The same file under another spelling, through a symlink, or a hard link.
    with pytest.raises(PipeswapError, match="is also an input"):
        check_writable(tmp_path / "." / "graph.json", inputs=[graph])
    (tmp_path / "link.json").symlink_to(graph)
    with pytest.raises(PipeswapError, match="is also an input"):
        check_writable(tmp_path / "link.json", inputs=[str(graph)])
    os.link(graph, tmp_path / "hard.json")
    with pytest.raises(PipeswapError, match="is also an input"):
        check_writable(tmp_path / "hard.json", inputs=[graph])
    check_writable(tmp_path / "out.json", inputs=[graph])


def test_check_writable_refuses_two_outputs_on_one_file(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    with pytest.raises(PipeswapError, match="out.json is given as two outputs"):
        check_writable(out, outputs=[tmp_path / "trace.json", str(out)])
    check_writable(out, outputs=[tmp_path / "trace.json"])


def test_check_writable_and_the_read_limit_are_public() -> None:
    assert callable(jsonio.check_writable) and jsonio.MAX_JSON_BYTES == 256 * 2**20


@pytest.fixture
def full_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 64 KiB tmpfs, almost full (skipped where this process may not mount one)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_keeps_the_old_report_and_no_temporary(full_disk: Path) -> None:
    """On a real full file system, through the CLI: exit 2, the file named, the old kept."""
    from pipeswap.cli import main

    report = full_disk / "p.json"
    report.write_text("old")
    filler = full_disk / "filler"
    with open(filler, "wb", buffering=0) as handle:  # take every free block
        try:
            while True:
                handle.write(b"x" * 1024)
        except OSError:
            pass
    argv = [
        "profile",
        "--model",
        "gpt2-micro",
        "--batch",
        "2",
        "--seq-len",
        "8",
        "--estimate",
        "--out",
        str(report),
    ]
    assert main(argv) == 2
    assert report.read_text() == "old"
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler", "p.json"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_an_output_that_is_no_regular_file_is_refused_and_kept(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        node = tmp_path / "pipe"
        os.mkfifo(node)
    else:
        node = Path("/dev/null")  # a character device every POSIX machine has
    for attempt in (lambda: check_writable(node), lambda: write_atomic(node, "{}")):
        with pytest.raises(PipeswapError, match="it is not a regular file"):
            attempt()
    assert not node.is_file()  # still the node, not replaced by a file
    if kind == "fifo":
        assert stat.S_ISFIFO(os.stat(node).st_mode)
    else:
        assert stat.S_ISCHR(os.stat(node).st_mode)


def test_check_writable_refuses_an_input_and_a_file_inside_an_input_folder(
    tmp_path: Path,
) -> None:
    """--report naming the run's --data, --metrics inside its model directory: refused."""
    corpus, model = tmp_path / "corpus.txt", tmp_path / "model"
    corpus.write_text("text")
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(PipeswapError, match="is also an input"):
        check_writable(corpus, inputs=[corpus, model])
    with pytest.raises(PipeswapError, match="inside .*model, a folder this run reads"):
        check_writable(model / "config.json", inputs=[corpus, model])
    with pytest.raises(PipeswapError, match="a folder this run reads"):
        check_writable(model / "new" / "report.json", inputs=[model])
    check_writable(tmp_path / "report.json", inputs=[corpus, model])  # beside them: fine
