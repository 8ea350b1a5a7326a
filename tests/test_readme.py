"""The README's quickstart runs as written, and uses only the names `import pipeswap` offers.

Covers: pipeswap/__init__.py.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pipeswap

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 5, "README.md: quickstart, own model, own loop, Trainer, Pipeline"
    return blocks


def _quickstart() -> str:
    return _python_blocks()[0]


def test_the_quickstart_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(_quickstart(), "README.md", "exec"), {"__name__": "__quickstart__"})
    out = capsys.readouterr().out
    assert "MiB for one training step" in out and "late_fetches=" in out


def _run_block(index: int, needs: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run README block ``index`` in ``folder`` (skipped without the package ``needs``)."""
    pytest.importorskip(needs)
    monkeypatch.chdir(folder)
    exec(compile(_python_blocks()[index], "README.md", "exec"), {"__name__": f"__block{index}__"})


def test_the_own_model_block_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_block(1, "transformers", tmp_path, monkeypatch)
    assert "'transformer.h.3', 'head']" in capsys.readouterr().out
    assert (tmp_path / "my-gpt2" / "config.json").is_file()


def test_the_own_loop_block_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_block(2, "transformers", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    # The short last batch runs the plan of the full ones, which covers it.
    assert "'learning_steps': 1, 'plans': 1, 'shape': '5x32, 5x32, 5x32'" in out
    assert "'planned_shape': '8x32, 8x32, 8x32'" in out and "'swapped_bytes': " in out


def test_the_trainer_block_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_block(3, "accelerate", tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert "'learning_steps': 1, 'plans': 1" in out and "'steps': 4" in out


def test_the_quickstart_uses_only_public_names() -> None:
    used = {
        node.attr
        for block in _python_blocks()
        for node in ast.walk(ast.parse(block))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "pipeswap"
    }
    assert used and used <= set(pipeswap.__all__)


def test_every_public_name_resolves_and_is_documented() -> None:
    # Few: the run's five configs (TrainConfig and its components), the mechanisms and the
    # two errors a user catches (ConfigError: a refused setting, as tracebacks name it).
    assert 10 <= len(pipeswap.__all__) <= 17
    assert issubclass(pipeswap.ConfigError, pipeswap.PipeswapError)
    for name in pipeswap.__all__:
        if name.startswith("__"):
            continue
        value = getattr(pipeswap, name)
        assert value.__doc__, name
    with pytest.raises(AttributeError, match="no attribute 'simulate'"):
        pipeswap.simulate  # noqa: B018


def test_all_lists_exactly_the_lazy_names() -> None:
    assert set(pipeswap.__all__) == {"PipeswapError", "__version__", *pipeswap._PUBLIC}


def test_train_stays_the_function_once_its_package_is_imported() -> None:
    import pipeswap.training  # noqa: F401 - a submodule import sets attributes on pipeswap

    assert callable(pipeswap.train) and pipeswap.train.__module__ == "pipeswap.training.run"


@pytest.mark.dist
def test_the_pipeline_script_runs_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "train_pipe.py").write_text(_python_blocks()[4])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*command, "--nproc-per-node", "2", "train_pipe.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("loss ") == 6
    assert (tmp_path / "pipe-out" / "config.json").is_file()
