"""pipeswap/training/pipe_checkpoint.py: a directory without a complete set is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.training.pipe_checkpoint import newest_checkpoint


def test_a_directory_without_a_complete_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "step-00000002").mkdir()  # a set whose manifest was never written
    with pytest.raises(ConfigError, match="no complete checkpoint there"):
        newest_checkpoint(tmp_path)
