"""pipeswap/pipeline/stage_cuts.py: what a stage keeps for its checkpoints, against the
cut's crossing messages (pipeswap.pipeline.snapshot)."""

from __future__ import annotations

import torch
from support import pipeline_run

from pipeswap.checkpoint import CheckpointPlan
from pipeswap.pipeline.emulator import pipeline_schedule
from pipeswap.pipeline.snapshot import crossing_messages
from pipeswap.pipeline.stage_cuts import StageCuts
from pipeswap.schedule.actions import ActionKind

STEPS = 13
RUN = pipeline_run(
    "gpt2-micro",
    (1, 1, 1, 1),
    schedule="async-1f1b",
    weights="spectrain",
    batch=4,
    seq_len=16,
    steps=STEPS,
    lr=0.05,
)


def _plan(every: int) -> CheckpointPlan:
    return CheckpointPlan("unused", every, {"test": "stage_cuts"}, 4)


def test_without_checkpoints_a_stage_keeps_nothing() -> None:
    cuts = StageCuts(None, pipeline_schedule(RUN), 0, STEPS)
    cuts.forward(0, [torch.nn.Parameter(torch.ones(2))])
    cuts.sent(ActionKind.F, 6, (torch.ones(3),))
    assert cuts.forward_weights == {} and cuts.kept == {} and cuts.crossing == set()


def test_a_stage_keeps_copies_of_exactly_the_sends_that_cross_the_next_cut() -> None:
    schedule = pipeline_schedule(RUN)
    cuts = StageCuts(_plan(4), schedule, 0, STEPS)
    crossing = crossing_messages(schedule, 4)[0]  # stage 0's activations of unit 6
    assert crossing == {("F", 6)}
    message = (torch.arange(3.0),)
    cuts.sent(ActionKind.F, 5, (torch.zeros(3),))  # not crossing: not kept
    cuts.sent(ActionKind.F, 6, message)
    assert list(cuts.kept) == [("F", 6)]
    kept = cuts.kept[("F", 6)][0]
    assert torch.equal(kept, message[0]) and kept.data_ptr() != message[0].data_ptr()
    # The forward's weights are copies too: a later update does not reach them.
    weight = torch.nn.Parameter(torch.ones(2))
    cuts.forward(6, [weight])
    with torch.no_grad():
        weight.add_(1)
    assert torch.equal(cuts.forward_weights[6][0], torch.ones(2))
    # A checkpoint after 4 steps holds them; the next cut (8 steps) is kept from then on.
    cuts.saved(4)
    assert cuts.crossing == {(ActionKind.F, 6)} and cuts.kept == {}
    cuts.sent(ActionKind.F, 6, message)
    assert cuts.kept == {}  # no longer crossing a cut to come
    upcoming = crossing_messages(schedule, 8)[0]
    assert upcoming
    for direction, unit in upcoming:
        cuts.sent(ActionKind(direction), unit, message)
        assert (str(direction), unit) in cuts.kept
