"""pipeswap/swap/plan/measured.py: a Profile's measured memory, recomputation inputs,
selective recomputation and optimizer step, in the Workload's terms, in closed form."""

from __future__ import annotations

import dataclasses

from support import toy_layer, toy_profile_of

from pipeswap.profiling.profile import Profile
from pipeswap.step_memory import StepMemory
from pipeswap.swap.plan.measured import (
    estimated_optimizer_step_s,
    gradients_held,
    measured_memory,
    recomputed_inputs,
    selective_fields,
)


def _profile() -> Profile:
    """Two layers saving 100 and 40 bytes, outputs of 30 and 20 bytes."""
    return toy_profile_of(
        [
            toy_layer("a", 1.0, 2.0, output_bytes=30, saved=[60, 40]),
            toy_layer("b", 1.0, 2.0, output_bytes=20, saved=[30, 10]),
        ]
    )


def test_each_point_is_the_reading_less_what_the_layers_so_far_saved() -> None:
    memory = StepMemory(
        start_bytes=1000,
        forward_peak_bytes=(1150, 1100),  # 50 beyond 100 saved; the second reads low: 0
        turn_peak_bytes=1200,
        backward_peak_bytes=(1130, 1160),
        step_peak_bytes=1500,
    )
    got = measured_memory(dataclasses.replace(_profile(), memory=memory))
    assert got.resident_bytes == 1000
    assert got.transient == (50, 0)  # 1100 - 1000 - 140 < 0 counts as 0
    assert got.backward_transient == (30, 20)
    assert (got.turn_bytes, got.floor_bytes) == (60, 1500)


def test_gradients_held_are_the_later_layers_and_the_outside_parameters() -> None:
    # Layer 0's 70 B are its own 50 B (as the smallest other layer's) and 20 B outside the
    # layers (the head's, the embeddings'); layer 1's backward starts with those 20 B.
    layers = [
        toy_layer("a", 1.0, 2.0, param_bytes=70, saved=[10]),
        toy_layer("b", 1.0, 2.0, param_bytes=50, saved=[10]),
        toy_layer("c", 1.0, 2.0, param_bytes=60, saved=[10]),
    ]
    memory = StepMemory(200, (0, 0, 0), 0, (0, 0, 0))  # parameters, no gradients
    profile = toy_profile_of(layers, memory=memory)
    assert gradients_held(profile) == (20 + 50 + 60, 20 + 60, 20)
    # Read at the start (a loop keeping its gradients), or not read: none beyond it.
    kept = dataclasses.replace(memory, start_bytes=profile.resident_bytes)
    assert gradients_held(dataclasses.replace(profile, memory=kept)) == ()
    assert gradients_held(toy_profile_of(layers)) == ()


def test_recomputed_inputs_measured_or_by_the_previous_output() -> None:
    # Unmeasured: layer 1 keeps layer 0's output (30 bytes, which it saves); layer 0 keeps
    # the batch only where it saves it (no seq_len or image size here: nothing).
    assert recomputed_inputs(_profile()) == ((0, 30), (0, 30))
    measured = dataclasses.replace(
        _profile(),
        layers=tuple(
            dataclasses.replace(layer, kept_bytes=kept, rerun_bytes=rerun)
            for layer, kept, rerun in zip(_profile().layers, (16, 30), (90, 10))
        ),
    )
    # Measured: kept as measured, and saved less what the re-run saves again.
    assert recomputed_inputs(measured) == ((16, 30), (10, 30))


def test_selective_fields_only_where_every_layer_measured_them() -> None:
    profile = _profile()
    one = dataclasses.replace(
        profile.layers[0], selective_kept_bytes=50, selective_rerun_bytes=40, selective_rerun_s=0.25
    )
    assert selective_fields(dataclasses.replace(profile, layers=(one, profile.layers[1]))) == {}
    two = dataclasses.replace(
        profile.layers[1], selective_kept_bytes=25, selective_rerun_bytes=5, selective_rerun_s=0.5
    )
    assert selective_fields(dataclasses.replace(profile, layers=(one, two))) == {
        "selective_kept": (50, 25),
        "selective_rerun": (40, 5),
        "selective_s": (0.25, 0.5),
    }


def test_the_optimizer_step_is_the_timed_one_or_none_without_a_known_gpu() -> None:
    profile = _profile()
    assert estimated_optimizer_step_s(dataclasses.replace(profile, optimizer_step_s=0.125)) == 0.125
    cpu = dataclasses.replace(profile, optimizer_step_s=None, device="cpu")
    assert estimated_optimizer_step_s(cpu) == 0.0
