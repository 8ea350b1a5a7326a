"""The workload: memory points, needs, budgets and recomputation, against closed forms.

Covers: pipeswap/swap/plan/workload.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.hardware.presets import preset
from pipeswap.sim.engine import simulate
from pipeswap.swap.plan.iteration import build_iteration_graph
from pipeswap.swap.plan.tensors import SwapDecisionAt
from pipeswap.swap.plan.workload import Workload, workload_from_profile

GB = 10**9


def test_peak_minimum_and_needs_closed_form(make_profile) -> None:
    # Saved 4, 2, 3 GB; resident = 2 * 3 * 0.01 GB; workspace 1 GB per layer.
    w = workload_from_profile(make_profile([(4,), (2,), (3,)], workspace_bytes=GB))
    resident = 2 * 3 * GB // 100
    assert w.resident_bytes == resident
    assert w.no_swap_peak_bytes() == resident + 9 * GB + GB
    assert w.min_budget_bytes() == resident + 4 * GB + GB
    budget = resident + 7 * GB
    # Forward i holds all saved of layers <= i plus its workspace.
    assert w.needs(budget) == [0, 0, 3 * GB]


def test_swapped_tensor_lowers_the_peak_by_its_size(make_profile) -> None:
    w = workload_from_profile(make_profile([(4,), (2,), (3,)]))
    swap = SwapDecisionAt(layer=0, index=0, bytes=4 * GB, out=0, prefetch=1)
    forward, backward = w.memory_points([swap])
    resident = w.resident_bytes
    # Gone from forward 1 on, back from backward 0 on (prefetch issued after backward 1).
    assert forward == [resident + 4 * GB, resident + 2 * GB, resident + 5 * GB]
    assert backward == [resident + 4 * GB, resident + 2 * GB, resident + 5 * GB]
    budget = resident + 5 * GB
    assert not w.fits([swap], budget - 1)
    assert w.fits([swap], budget)
    graph = build_iteration_graph(w, ["gpu0"], {"gpu0": [swap]})
    result = simulate(graph, preset("switch-4").with_gpu_memory(budget))
    assert result.gpus["gpu0"].peak_bytes <= budget
    # The 4 GB swap-out at 12 GB/s takes 1/3 s and forward 1 waits for its memory; the
    # prefetch issued after backward 1 takes 1/3 s more, which backward 0 waits for.
    assert result.makespan_s == pytest.approx(9.0 + 2 / 3)
    assert result.tasks["gpu0/m0/out0.0"].end_s == pytest.approx(1 + 1 / 3)


def test_profile_without_saved_data_is_refused_with_the_command(make_profile) -> None:
    profile = dataclasses.replace(make_profile([(1,)] * 2), has_saved_data=False)
    # Prose that reads right in both vocabularies (as a command it had lost its dashes).
    with pytest.raises(ConfigError) as refused:
        workload_from_profile(profile)
    flags = refused.value.render(lambda name: "--" + name.replace("_", "-"))
    assert "the profile command with --model toy, --batch 1, --estimate and --gpu v100" in flags


# ---- recomputation -------------------------------------------------------------------------
def _recompute_profile(make_profile):
    # Saved 4, 2 and (3 + 1) GB; every output 1 GB (the working set of each layer, and what
    # a recomputed layer keeps); layer 2 saves its 1 GB input among its tensors.
    return make_profile([(4,), (2,), (3, 1)], output_gb=1)


def test_recompute_memory_closed_form(make_profile) -> None:
    w = workload_from_profile(_recompute_profile(make_profile))
    r = w.resident_bytes
    assert w.kept_bytes == (0, GB, GB)  # the toy batch is not among layer 0's tensors
    assert w.input_saved == (0, 0, GB)
    assert w.freed_bytes == (4 * GB, GB, 3 * GB)
    view = w.recomputing({1, 2})
    assert view is w.recomputing([2, 1]) and view.recomputing(()) is w
    # Forward holds layer 0's 4 GB and the two inputs (distinct tensors, each once).
    assert view.saved_bytes == (4 * GB, GB, GB)
    # The re-run of layer 2 saves its 4 GB again but not its input (already kept).
    assert view.recompute_bytes == (0, 2 * GB, 3 * GB)
    assert view.swappable == (w.saved[0], (), ())
    forward, backward = view.memory_points([])
    assert forward == [r + 5 * GB, r + 6 * GB, r + 7 * GB]
    assert backward == [r + 5 * GB, r + 8 * GB, r + 10 * GB]
    assert view.no_swap_peak_bytes() == r + 10 * GB < w.no_swap_peak_bytes() == r + 11 * GB
    assert view.microbatch_s == w.microbatch_s + 2.0  # two forwards of 1 s again


def _measured(**fields: object) -> Workload:
    """Two layers as a meter read them: 100 B resident; layer 0 saves 50 B (its 10 B
    input among them), layer 1 40 B; forward working sets 20 and 30 B, backward 60 and 35 B;
    the gradients held when each backward starts 40 and 25 B."""
    base: dict[str, object] = dict(
        model="toy",
        names=("a", "b"),
        forward_s=(1.0, 1.0),
        backward_s=(1.0, 1.0),
        saved=(((0, 40), (1, 10)), ((0, 40),)),
        transient=(20, 30),
        param_bytes=(40, 25),
        resident_bytes=100,
        optimizer_step_s=0.0,
        input_bytes=(10, 10),
        input_saved=(10, 0),
        backward_transient=(60, 35),
        gradient_bytes=(40, 25),
    )
    base.update(fields)
    return Workload(**base)  # type: ignore[arg-type]


def test_a_rerun_holds_the_gradients_made_before_it() -> None:
    # Layer 0's re-run runs its forward's 20 B beside the 40 B of gradients its backward
    # starts with (BERT: the head's and later layers', 0.6 MB over the budget): 60 B, as
    # many as its backward's working set; layer 1's 30 + 25 B exceed its backward's 35 B.
    view = _measured().recomputing({0, 1})
    assert view.rerun_working == (60, 55)
    _, backward = view.memory_points([])
    assert backward == [100 + 10 + 60 + 40, 100 + 20 + 55 + 40]
    # No more gradients than the backward's working set held (a reading with no room).
    assert _measured(backward_transient=(60, 0)).rerun_working == (60, 30)
    assert _measured(gradient_bytes=()).rerun_working == (20, 30)  # an estimate: resident
    graph = build_iteration_graph(view, ["gpu0"], {"gpu0": []}, recompute={"gpu0": {0, 1}})
    peak = simulate(graph, preset("switch-4").with_gpu_memory(10**6)).gpus["gpu0"].peak_bytes
    assert peak == max(backward)


def test_a_rerun_holds_its_output_s_gradient_where_its_forward_had_no_room_for_it() -> None:
    # Layer 1's re-run holds the gradient of its output too (12 B, where the working set its
    # forward was read with did not count that output: it saves it, as a ResNet block's last
    # ReLU does): 30 + 25 + 12 B; no more than its backward's working set (here 50 B), as
    # for any gradient.
    view = _measured(output_gradient_bytes=(0, 12), backward_transient=(60, 50)).recomputing({0, 1})
    assert view.rerun_working == (60, 67)
    assert _measured(output_gradient_bytes=(0, 12), backward_transient=(60, 0)).recomputing(
        {1}
    ).rerun_working == (60, 30)


def test_recompute_and_swap_together_within_budget(make_profile) -> None:
    # Layer 0's 4 GB swapped, layers 1 and 2 recomputed: every point fits resident + 6 GB.
    w = workload_from_profile(_recompute_profile(make_profile))
    view = w.recomputing({1, 2})
    swap = SwapDecisionAt(0, 0, 4 * GB, out=0, prefetch=1)
    budget = w.resident_bytes + 6 * GB
    assert view.fits([swap], budget) and not view.fits([swap], budget - 1)
    assert not w.fits([swap], budget)
    graph = build_iteration_graph(w, ["gpu0"], {"gpu0": [swap]}, recompute={"gpu0": {1, 2}})
    result = simulate(graph, preset("switch-4").with_gpu_memory(budget))
    assert result.gpus["gpu0"].peak_bytes <= budget
    # The prefetch is issued after backward 1 and backward 0 waits for its 4 GB at 12 GB/s.
    assert result.makespan_s == pytest.approx(11.0 + 4 / 12)


def test_a_timed_optimizer_step_is_the_workloads_step(make_profile) -> None:
    profile = make_profile([(4,), (2,)])
    timed = dataclasses.replace(profile, optimizer_step_s=0.25)
    assert workload_from_profile(timed).optimizer_step_s == 0.25
    assert workload_from_profile(timed, optimizer_step_s=1.0).optimizer_step_s == 1.0
    # Untimed on a GPU spec: estimated from its memory bandwidth, not 0.25.
    assert workload_from_profile(profile).optimizer_step_s != 0.25


def test_a_layer_that_keeps_state_is_never_recomputed() -> None:
    # Layer 0 leaves a tensor carrying its graph on its module: its re-run would keep what it
    # saves until the next forward, so it frees nothing and no recompute set may hold it.
    w = _measured(held_state=("state", ""))
    assert w.recomputable == (1,) and w.held(0) == "state" and w.held(1) == ""
    assert w.freed_bytes == (0, 30)
    with pytest.raises(PipeswapError, match="'a' cannot be recomputed: its forward leaves state"):
        w.recomputing({0, 1})
    kept = w.saved_bytes[0] + w.working_bytes[0]  # layer 0 can only be kept (or swapped)
    view = w.recomputing({1})
    least = min(w.saved_bytes[1] + w.working_bytes[1], view.saved_bytes[1] + view.working_bytes[1])
    assert w.min_budget_bytes() == w.resident_bytes + max(kept, least)
    assert _measured().recomputable == (0, 1)
