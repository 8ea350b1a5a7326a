"""pipeswap/pipeline/stage_result.py: what a stage reports crosses processes whole."""

from __future__ import annotations

import pickle

from pipeswap.metrics import HeldOutSums
from pipeswap.pipeline.stage_result import StageResult


def test_a_stage_result_survives_pickling_with_its_scores() -> None:
    result = StageResult(1, losses={0: 2.5}, held_out=HeldOutSums(2, 3.0, 1, 8))
    result.evals.append((4, {"batches": 2, "loss": 1.5}))
    back = pickle.loads(pickle.dumps(result))
    assert back == result and back.held_out.score(2, classify=True) == {
        "batches": 2,
        "loss": 1.5,
        "accuracy": 0.125,
    }
