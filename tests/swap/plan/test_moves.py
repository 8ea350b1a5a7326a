"""pipeswap/swap/plan/moves.py: every move of auto's search keeps a plan that fits."""

from __future__ import annotations

import random

from pipeswap.hardware.presets import preset
from pipeswap.swap.plan.moves import Moves
from pipeswap.swap.plan.planner import make_case
from pipeswap.swap.plan.policies import heuristic


def test_sampled_moves_keep_every_gpu_within_its_budget(make_profile) -> None:
    profile = make_profile([(2, 1), (3,), (2, 2), (1,)], output_gb=0.5)
    case = make_case(profile, preset("switch-4"), gpus=2, footprint_ratio=1.4)
    start = heuristic(case, "disjoint")
    swaps = {gpu: tuple(start.swaps[gpu]) for gpu in case.gpus}
    moves = Moves(case, case.gpus, random.Random(0))
    state = (swaps, {}, {})
    made = 0
    for _ in range(300):
        moved = moves.sample(*state)
        if moved is None:
            continue
        made += 1
        plan, offsets, recompute = moved
        for gpu in case.gpus:
            view = case.workload.recomputing(recompute.get(gpu, ()))
            assert view.fits(plan[gpu], case.budget_bytes)
            keys = [(s.layer, s.index) for s in plan[gpu]]
            assert len(keys) == len(set(keys))  # no tensor swapped twice
            assert all(
                s.layer <= s.out and s.layer < s.prefetch <= view.num_layers for s in plan[gpu]
            )
        assert all(o >= 0 for o in offsets.values())
        state = moved
    assert made > 10  # the search does move
