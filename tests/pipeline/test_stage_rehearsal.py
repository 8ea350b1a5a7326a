"""What each stage holds as it rehearses, read by the meter: on the CPU and on the meta device alike.

Covers: pipeswap/pipeline/stage_rehearsal.py (and
pipeswap.training.pipeline_stage_swaps.measured_stage_costs, which counts it in a stage's plan).
"""

from __future__ import annotations

from dataclasses import replace

from support import pipeline_run

from pipeswap.pipeline.job import build_full_model, build_meta_model
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.stage_rehearsal import rehearse_stages
from pipeswap.profiling.measure import measure
from pipeswap.schedule.partition import stage_bounds
from pipeswap.swap.plan.stage_costs import stage_costs
from pipeswap.train_config import TrainConfig
from pipeswap.training.pipeline_stage_swaps import measured_stage_costs


def _config(**fields: object) -> TrainConfig:
    """gpt2-tiny (6 layers, its head tied to its embedding) in 2 stages of 3 layers."""
    given = {"seq_len": 32, "steps": 2, "device": "cpu", "micro_batches": 4, **fields}
    return resolve_pipeline(pipeline_run("gpt2-tiny", (3, 3), batch=16, **given))


def test_each_stage_holds_its_weights_a_tied_copy_gradients_state_and_units() -> None:
    config = _config()
    readings = rehearse_stages(config)
    model = build_meta_model(config)
    for (first, end), reading in zip(stage_bounds((3, 3)), readings):
        own = sum(p.numel() * 4 for p in model.stage(first, end).parameters())
        # Stage 1 holds a copy of the embedding its head is tied to.
        assert reading.weight_bytes >= own and reading.gradient_bytes == reading.weight_bytes
        assert reading.state_bytes == reading.weight_bytes  # SGD's momentum, one per weight
        assert reading.unit_bytes > reading.forward_bytes > 0 and reading.backward_bytes > 0
        assert reading.resident_bytes == (
            reading.weight_bytes
            + reading.gradient_bytes
            + reading.state_bytes
            + reading.message_bytes
            + reading.batch_bytes
        )
    tied = dict(model.named_parameters())["embed.tokens.weight"]
    own = sum(p.numel() * 4 for p in model.stage(3, 6).parameters() if p is not tied)
    assert readings[1].weight_bytes == own + tied.numel() * 4
    # On the meta device (plans for CUDA) the same storages, so the same figures.
    assert rehearse_stages(replace(config, device="cuda")) == readings


def test_a_plan_counts_what_the_rehearsal_held_and_never_less_than_the_profile() -> None:
    config = _config()
    profile = measure(build_full_model(config), config.micro_batch_size, seq_len=32)
    costs = stage_costs(profile, (3, 3), schedule="1f1b", micro_batches=1, weights="stale")
    for c, reading in zip(costs, rehearse_stages(config)):
        measured = measured_stage_costs(c, reading)
        assert measured.resident_bytes == max(c.resident_bytes, reading.resident_bytes)
        assert measured.unit_extra_bytes == max(0, reading.unit_bytes - c.saved_bytes)
        assert measured.backward_working_bytes >= measured.transient_bytes >= c.transient_bytes
        assert measured.saved == c.saved  # what a plan may swap is the profile's
