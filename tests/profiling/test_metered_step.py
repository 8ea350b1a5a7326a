"""pipeswap/profiling/metered_step.py: a step run aside, read at every layer's edge, leaves
the model, its gradients and the random generators as they were."""

from __future__ import annotations

import dataclasses

import torch

from pipeswap.models.registry import build_model
from pipeswap.profiling.meter import StorageMeter
from pipeswap.profiling.metered_step import layered_step_memory, metered_step


def test_a_step_aside_reads_what_the_plain_step_holds_and_touches_nothing() -> None:
    model = build_model("gpt2-micro").train()
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    children = dict(model.named_children())
    layers = {name: children[name] for name in model.layer_names}
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    before = torch.random.get_rng_state()
    timing, peak = metered_step(
        model, lambda: model.loss(model(x), y), layers, torch.device("cpu"), holding=(model, x, y)
    )
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # put back as they were
    assert torch.equal(torch.random.get_rng_state(), before)
    assert timing.marks is not None
    assert set(timing.marks.peaks) == {"turn", *(f"{d}:{n}" for d in "fb" for n in layers)}
    for p in model.parameters():
        p.grad = None
    with StorageMeter(holding=(model, x, y)) as meter:
        model.loss(model(x), y).backward()
    assert peak == meter.peak  # the plain step's own peak, to the byte


def test_the_meta_device_reads_what_the_cpu_does() -> None:
    model = build_model("gpt2-micro").train()
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    cpu = layered_step_memory(model, x, y, torch.device("cpu"), "adamw")
    meta_model = build_model("gpt2-micro", device="meta").train()
    meta = layered_step_memory(
        meta_model, x.to("meta"), y.to("meta"), torch.device("meta"), "adamw"
    )
    assert cpu is not None and meta is not None
    assert meta.forward_peak_bytes == cpu.forward_peak_bytes
    assert meta.turn_peak_bytes == cpu.turn_peak_bytes


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    note: str = "a field that is no tensor"


def test_an_output_dataclass_is_backed_through_as_a_dict_is() -> None:
    """The pytree takes a dataclass for one leaf: its tensors are found by their fields,
    so the step aside runs its backward (and reads its peak) as for a dict."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 8)
    layers = {"0": net[0], "2": net[2]}
    cpu = torch.device("cpu")
    peaks = [
        metered_step(net, lambda wrap=wrap: wrap(net(x)), layers, cpu, holding=(net, x))[1]
        for wrap in (lambda h: {"hidden": h}, _Out)
    ]
    assert peaks[0] == peaks[1]
    forward_only = metered_step(net, lambda: net(x).detach(), layers, cpu, holding=(net, x))[1]
    assert peaks[1] > forward_only  # its backward ran: gradients were held


def test_weight_casts_cached_by_an_earlier_step_of_the_region_are_read() -> None:
    """measure runs its timed steps and then the metered one inside the caller's autocast
    region: the casts the earlier steps cached were made before the meter began, and were
    left out of every reading (a bf16 Llama's backward read 1.2 MB short). The metered
    step makes its own casts, as a loop's step under its own region does."""
    model = build_model("gpt2-micro").train()
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fresh = layered_step_memory(model, x, y, torch.device("cpu"), "adamw")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.loss(model(x), y).backward()  # an earlier step of the same region
        for p in model.parameters():
            p.grad = None
        after = layered_step_memory(model, x, y, torch.device("cpu"), "adamw")
    assert fresh is not None and after == fresh


class _NotesAutocast(torch.autograd.Function):
    """Identity whose backward notes whether autocast is on while it runs."""

    seen: list[bool] = []

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        _NotesAutocast.seen.append(torch.is_autocast_enabled("cpu"))
        return grad


def test_a_step_aside_runs_its_backward_outside_the_callers_autocast_region() -> None:
    """A loop's backward runs after its autocast region; called inside one, the engine runs
    the backward's ops under it, casting what the loop's does not: a wav2vec2 step aside
    (offload.plan_for under bf16) read 0.5 MB less in its backward, and its plan held
    1.0196x its budget."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    layers = {"0": net[0], "1": net[1]}
    _NotesAutocast.seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        metered_step(
            net,
            lambda: _NotesAutocast.apply(net(x)).float().sum(),
            layers,
            torch.device("cpu"),
            holding=(net, x),
        )
    assert _NotesAutocast.seen == [False]
