"""pipeline_robustness.py's bookkeeping: recovery, divergence counting and the targets.

The grid itself takes half an hour (docs/results/pipeline_robustness.md); these check its
arithmetic on made-up records, without training.
"""

from __future__ import annotations

import math
import sys

import pytest
from bench_support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import pipeline_robustness as robust  # noqa: E402


def test_recovery_is_the_share_of_the_penalty_and_divergence_counts_zero() -> None:
    assert robust.recovery(3.0, 2.0, 2.25) == 0.75
    assert robust.recovery(3.0, 2.0, 3.5) == -0.5
    assert robust.recovery(3.0, 2.0, None) == 0.0  # the mode diverged
    assert robust.recovery(None, 2.0, 2.9) == 1.0  # stale diverged, the mode did not
    assert math.isnan(robust.recovery(2.0, 2.0, 2.0))  # no penalty to recover


def test_summary_counts_recommended_divergence_only_where_1f1b_converged() -> None:
    lr_ok, lr_bad = robust.LRS[("lm", "sgd")][:2]
    records: dict[tuple[object, ...], float | None] = {
        ("lm", 4, "sgd", lr_ok, "sync 1f1b"): 2.0,
        ("lm", 4, "sgd", lr_ok, "stale"): 3.0,
        ("lm", 4, "sgd", lr_ok, "spectrain"): 2.75,
        ("lm", 4, "sgd", lr_ok, "2bw spectrain"): None,
        ("lm", 4, "sgd", lr_bad, "sync 1f1b"): None,  # 1F1B diverged: no cell
        ("lm", 4, "sgd", lr_bad, "spectrain"): None,
    }
    lines, cells, diverged = robust.summary(records, ["lm"])
    assert cells == [("lm", "sgd", 4, lr_ok, 0.25)]
    assert diverged == 1
    assert "2bw spectrain" in lines[-1]
    targets = robust.criteria(cells, diverged, [])
    assert targets[0].endswith(": 1.")
    assert f"lm sgd K=4 lr {lr_ok:g} (25%)" in targets[2]  # below 50%


def test_seed_means_take_1f1b_from_k4_and_the_best_recommended_mode_per_image_cell() -> None:
    lr = robust.LRS[("image", "sgd")][0]
    seeds = (0, *robust.MORE_SEEDS)
    rows = [r.label for r in robust.rows_of("image", "sgd") if r.recommended]
    seeded: dict[tuple[object, ...], float | None] = {}
    for s in seeds:
        seeded[("image", 4, "sgd", lr, "sync 1f1b", s)] = 1.0  # one 1F1B run serves K = 8
        seeded[("image", 8, "sgd", lr, "stale", s)] = 2.0
        for n, label in enumerate(rows):
            # the first mode: 1.5 at every seed; the second: diverges at seed 2
            seeded[("image", 8, "sgd", lr, label, s)] = 1.5 if n == 0 else (1.2, 1.2, None)[s]
    runs = robust.seed_means(seeded, ("image", 8, "sgd", lr), rows[0])
    assert runs == [[1.0] * 3, [2.0] * 3, [1.5] * 3]
    assert robust.recovery_of_means(runs) == 0.5
    assert (
        robust.recovery_of_means(robust.seed_means(seeded, ("image", 8, "sgd", lr), rows[1])) == 0.0
    )
    assert robust.best_of_means(seeded, "image") == [0.5]
    text = robust.criteria([("image", "sgd", 8, lr, 0.4)], 0, [0.5])[3]
    assert text.endswith("40% to 40%; of the means over seeds 0-2: 50% to 50%.")


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_recommended_rows_are_the_modes_the_rule_is_on_for(optimizer: str) -> None:
    from pipeswap.schedule.modes import weight_mode

    for row in robust.rows_of("lm", optimizer):
        default_on = weight_mode(row.weights).recommended and row.power is None
        assert row.recommended == default_on, row
