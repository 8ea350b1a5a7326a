"""pipeswap/pipeline/exchange.py: tied gradients between holding ranks (bounded tags).

Its transfers run in tests/pipeline/test_tied.py (models with tied weights across stages)."""

from __future__ import annotations

import pytest
import torch

from pipeswap.errors import PipeswapError
from pipeswap.pipeline.exchange import DistExchange


def test_more_tied_tensors_than_the_tag_packs_are_refused_before_any_transfer() -> None:
    exchange = DistExchange(0, {}, torch.device("cpu"))
    too_many = [torch.zeros(1)] * (DistExchange.MAX_TENSORS + 1)
    with pytest.raises(PipeswapError, match="tie fewer parameters across stages"):
        exchange.send(0, 0, 1, too_many)
