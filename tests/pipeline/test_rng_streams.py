"""RNG streams: dropout masks depend on (seed, mini-batch, micro-batch, stage), nothing else.

Covers: pipeswap/pipeline/rng.py (and its use in pipeswap/pipeline/executor.py).
"""

from __future__ import annotations

import itertools

import torch
from support import pipeline_run

from pipeswap.config_fields import replace_fields
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.rng import EVAL, TRAIN, rng_stream, stream_seed

TIED = pipeline_run(
    "pipeline_toys:toy_tied_lm", (2, 3), batch=8, seq_len=16, steps=4, lr=0.05, eval_batches=1
)


def test_stream_seeds_are_pinned_and_distinct() -> None:
    # A stable hash (SHA-256), not hash(): these values hold on every run and machine.
    assert stream_seed(0, TRAIN, 0, 0, 0) == 6313278755725206785
    assert stream_seed(7, EVAL, 3, 1, 2) == 286186274576478180
    keys = list(itertools.product((0, 1), (TRAIN, EVAL), (0, 1, 2), (0, 1), (0, 1, 2)))
    seeds = {stream_seed(*key) for key in keys}
    assert len(seeds) == len(keys) and all(0 <= s < 2**63 for s in seeds)


def test_a_stream_repeats_its_draws_and_restores_the_callers_state() -> None:
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with rng_stream(3, TRAIN, 2, 1, 0):
        a = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), state)
    with rng_stream(3, TRAIN, 2, 1, 0):
        b = torch.rand(8)
    with rng_stream(3, TRAIN, 2, 1, 1):
        c = torch.rand(8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)


def test_dropout_masks_do_not_depend_on_the_execution_order() -> None:
    """gpipe and 1f1b run the same micro-batches in different orders: bit-identical."""
    gpipe = Emulator(replace_fields(TIED, schedule="gpipe", micro_batches=4)).run()
    one_f_one_b = Emulator(replace_fields(TIED, schedule="1f1b", micro_batches=4)).run()
    assert gpipe.losses == one_f_one_b.losses and gpipe.eval == one_f_one_b.eval
    assert gpipe.params_sha256 == one_f_one_b.params_sha256
    # Dropout is on: without it the same run trains differently (the test is not vacuous).
    nodrop = replace_fields(TIED, model="pipeline_toys:toy_tied_lm_nodrop", micro_batches=4)
    assert Emulator(nodrop).run().losses != gpipe.losses
