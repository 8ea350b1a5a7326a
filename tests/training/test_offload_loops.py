"""pipeswap.offload in loops that change what a forward saves: two forwards before one
backward, blocks unfrozen mid-run, a frozen first block, two offloads of one model,
gradients held into the forward, and copies of a model with a plan attached.

Covers: pipeswap/training/offload.py, pipeswap/training/loop_shapes.py (trainable_changed,
grads_held), pipeswap/profiling/block_timing.py (layers with no backward),
pipeswap/swap/runtime/transfer.py (a region a backward has yet to read) and
pipeswap/swap/runtime/attached.py (copies).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.profiling.meter import DeviceMeter
from pipeswap.training.offload import offload

pytestmark = pytest.mark.usefixtures("one_thread")

Result = tuple[list[float], list[torch.Tensor]]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(nn.functional.gelu(self.fc1(h)))


class _Net(nn.Module):
    def __init__(self, frozen: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(64, 1)
        for block in self.blocks[:frozen]:
            block.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def _equal(a: Result, b: Result) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True))


def _two_views(model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]) -> Result:
    """A loss over two views of each batch: both forwards run before the one backward."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        x1, x2 = torch.randn(2, 16, 128, 64, generator=generator)
        with wrap():
            a = model(x1)
            b = model(x2)
        loss = (a - b) ** 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["save-on-cpu", "bidirectional"])
def test_two_forwards_before_one_backward_train_as_the_loop_and_say_what_it_costs(
    policy: str,
) -> None:
    """The second forward's swaps would write over host regions whose tensors the first
    forward's backward has yet to read: those come back to the device first."""
    plain = _two_views(_Net(), nullcontext)
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy=policy)
    with pytest.warns(UserWarning, match="two forwards before one backward"):
        assert _equal(_two_views(model, lambda: off), plain)
    assert off.stats()["swapped_bytes"] > 0
    off.close()


def _unfreezing(
    model: nn.Module, off: Any, optimizer: torch.optim.Optimizer, unfreeze_at: int
) -> tuple[Result, list[float]]:
    generator = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    for step in range(7):
        if step == unfreeze_at:
            model.blocks[:2].requires_grad_(True)
        x = torch.randn(16, 128, 64, generator=generator)
        holding = (model, optimizer, x)
        pools = off.host_pools() if off is not None else []
        with DeviceMeter("cpu", holding=holding, exclude=pools) as meter:
            with off if off is not None else nullcontext():
                loss = model(x)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        peaks.append(meter.peak)
    return (losses, [p.detach().clone() for p in model.parameters()]), peaks


def test_blocks_unfrozen_mid_run_are_planned_again_within_the_budget() -> None:
    """Unfrozen blocks save tensors the plan made while they were frozen never named: the
    shape is learnt and planned again, within the run's budget, as a fresh offload is."""
    plain_model = _Net(frozen=2)
    plain, _ = _unfreezing(
        plain_model, None, torch.optim.AdamW(plain_model.parameters(), lr=1e-3), unfreeze_at=3
    )
    model = _Net(frozen=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    budget = 14 * 2**20
    off = offload(model, gpu_memory=budget, optimizer=optimizer)
    ours, peaks = _unfreezing(model, off, optimizer, unfreeze_at=3)
    assert _equal(ours, plain)
    stats = off.stats()
    assert stats["learning_steps"] == 2 and stats["unmatched_tensors"] == 0
    # Steps 0 and 3 are learnt, 1 and 4 plan; the plans' later steps hold the budget.
    for step in (2, 5, 6):
        assert peaks[step] <= budget * 1.02, (step, peaks, budget)
    off.close()


def _frozen_loop(model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]) -> Result:
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        with wrap():
            loss = model(torch.randn(16, 128, 64, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("frozen", [1, 2])
def test_frozen_first_blocks_have_no_backward_and_are_planned(frozen: int) -> None:
    plain = _frozen_loop(_Net(frozen), nullcontext)
    model = _Net(frozen)
    off = offload(model, footprint_ratio=1.5, policy="save-on-cpu")
    assert _equal(_frozen_loop(model, lambda: off), plain)
    stats = off.stats()
    assert (stats["learning_steps"], stats["plans"], stats["steps"]) == (1, 1, 3)
    assert stats["swapped_bytes"] > 0
    off.close()
    # offload.plan_for plans such a model before the loop too.
    model = _Net(frozen)
    off = offload(model, footprint_ratio=1.5, policy="save-on-cpu")
    off.plan_for(torch.randn(16, 128, 64))
    assert _equal(_frozen_loop(model, lambda: off), plain)
    assert off.stats()["learning_steps"] == 0
    off.close()


def test_every_block_frozen_the_head_alone_training_is_planned_or_refused() -> None:
    """A linear probe: no block has a backward; the step still ends at the head's. Before:
    each call was learnt again, no budget held or refused, and a warning blamed a teacher."""
    plain = _frozen_loop(_Net(4), nullcontext)
    model = _Net(4)
    off = offload(model, footprint_ratio=1.5, policy="auto")
    with pytest.raises(ConfigError, match="the smallest budget that works is ") as refused:
        _frozen_loop(model, lambda: off)
    off.close()
    smallest = int(str(refused.value).split("the smallest budget that works is ")[1].split()[0])
    model = _Net(4)
    off = offload(model, gpu_memory=smallest, policy="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    for _ in range(4):
        x = torch.randn(16, 128, 64, generator=generator)
        with DeviceMeter("cpu", holding=(model, optimizer, x), exclude=off.host_pools()) as meter:
            with off:
                loss = model(x)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        peaks.append(meter.peak)
    assert _equal((losses, [p.detach().clone() for p in model.parameters()]), plain)
    stats = off.stats()
    assert (stats["learning_steps"], stats["plans"], stats["steps"]) == (1, 1, 3)
    assert max(peaks[1:]) <= smallest
    off.close()


def test_two_offloads_of_one_model_do_not_nest() -> None:
    model = _Net()
    first, second = offload(model, footprint_ratio=1.5), offload(model, footprint_ratio=1.5)
    with first, pytest.raises(RuntimeError, match="do not nest"):
        with second:
            pass
    with second:  # one at a time is fine
        loss = model(torch.randn(2, 8, 64))
    loss.backward()
    first.close()
    second.close()  # (the count a learnt step keeps on for its optimizer step ends)


def _accumulating(
    model: nn.Module,
    wrap: Callable[[], AbstractContextManager[Any]],
    *,
    accumulate: int,
    set_to_none: bool,
    pools: Callable[[], Any] = list,
) -> tuple[Result, list[float]]:
    """Gradients held into the forward: accumulated over micro-batches, or zeroed and kept;
    each micro-batch's whole step under the meter."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, peaks = [], []
    for i in range(8):
        x = torch.randn(16, 128, 64, generator=generator)
        with DeviceMeter("cpu", holding=(model, optimizer, x), exclude=pools()) as meter:
            with wrap():
                loss = model(x) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
        peaks.append(meter.peak)
    return (losses, [p.detach().clone() for p in model.parameters()]), peaks


@pytest.mark.parametrize(
    ("accumulate", "set_to_none", "planned_first"),
    [(4, True, False), (1, False, False), (4, True, True)],
    ids=["accumulating", "zeroed-and-kept", "plan_for-then-accumulating"],
)
def test_gradients_held_into_the_forward_are_within_the_budget(
    accumulate: int, set_to_none: bool, planned_first: bool
) -> None:
    """Plans made without them (the first step; plan_for's call) are made again, before the
    first forward that holds them, for every reading that much higher: 1.13x the budget
    before, on the meter."""
    plain, _ = _accumulating(_Net(), nullcontext, accumulate=accumulate, set_to_none=set_to_none)
    model = _Net()
    off = offload(model, footprint_ratio=1.2, optimizer="adamw")
    if planned_first:
        off.plan_for(torch.randn(16, 128, 64))
    swapped, peaks = _accumulating(
        model, lambda: off, accumulate=accumulate, set_to_none=set_to_none, pools=off.host_pools
    )
    assert _equal(plain, swapped)
    budget = off.stats()["budget_bytes"]
    assert max(peaks[1:]) <= budget * 1.02, [round(p / budget, 3) for p in peaks]
    assert off.shapes.grad_bytes == sum(p.nbytes for p in model.parameters())


@pytest.mark.parametrize("policy", ["recompute", "save-on-cpu"])
def test_a_copy_of_a_model_with_a_plan_attached_is_the_model_without_it(policy: str) -> None:
    """An EMA or teacher copy (copy.deepcopy) runs its own weights, not the original's
    layers (a recomputing plan's wrappers were copied bound to them); torch.save(model)
    while attached pickles."""
    import copy
    import io

    model = _Net()
    off = offload(model, footprint_ratio=1.3, policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(16, 128, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        with off:
            loss = model(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert off.stats()["recomputed_layers"] == (4 if policy == "recompute" else 0)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.blocks.parameters():
            p.mul_(0.5)
    fresh = _Net()
    fresh.load_state_dict(twin.state_dict())
    with off:
        got = twin(x)
    assert torch.equal(got, fresh(x)) and not torch.equal(got, model(x))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x), model(x))


class _CheckpointingNet(_Net):
    """A model that already checkpoints every other block itself (torch's non-reentrant)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i % 2 == 0 else block(x)
        return self.head(x).pow(2).mean()


def _plain_steps(
    model: nn.Module,
    wrap: Callable[[], AbstractContextManager[Any]],
    each: Callable[[int, list[float]], None] = lambda step, losses: None,
) -> Result:
    """Four steps of the loop (dropout drawn from one seed), ``each`` called after each."""
    torch.manual_seed(3)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses: list[float] = []
    for step in range(4):
        with wrap():
            loss = model(torch.randn(8, 128, 64, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        each(step, losses)
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["recompute", "finer"])
def test_blocks_the_user_checkpoints_themselves_are_recomputed_as_in_their_forward(
    policy: str,
) -> None:
    """The user's checkpoint runs a planned block again in the backward: it runs as in the
    forward (torch refused the re-run with a CheckpointError before), bit-identical."""
    plain = _plain_steps(_CheckpointingNet(), nullcontext)
    model = _CheckpointingNet()
    off = offload(model, footprint_ratio=1.2, policy=policy)
    assert _equal(plain, _plain_steps(model, lambda: off))
    assert off.stats()["recomputed_layers"] > 0


def _retaining(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]], pools: Any = list
) -> tuple[Result, list[float]]:
    """Two losses, two backwards over one graph: the first keeps it (retain_graph=True)."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, peaks = [], []
    for _ in range(4):
        x = torch.randn(16, 128, 64, generator=generator)
        with DeviceMeter("cpu", holding=(model, optimizer, x), exclude=pools()) as meter:
            with wrap():
                out = model(x)
            (out * 2).backward(retain_graph=True)
            out.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.item())
        peaks.append(meter.peak)
    return (losses, [p.detach().clone() for p in model.parameters()]), peaks


def test_a_graph_kept_for_a_second_backward_sends_its_swapped_tensors_back_and_says_so() -> None:
    """Swapped tensors a retained graph still holds go back to the host once their layer's
    backward is done (the second backward fetches them again); what the plan keeps stays
    with the graph, beyond the budget, which a warning says (1.71x silently before)."""
    plain, plain_peaks = _retaining(_Net(), nullcontext)
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy="save-on-cpu")
    with pytest.warns(RuntimeWarning, match=r"retain_graph=True"):
        swapped, peaks = _retaining(model, lambda: off, off.host_pools)
    assert _equal(plain, swapped)
    budget = off.stats()["budget_bytes"]
    assert max(peaks[2:]) <= budget * 1.05 < max(plain_peaks), max(peaks[2:]) / budget


def _upstream(model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]) -> Result:
    """An encoder of the user's, not offloaded, feeds the model: one backward through both."""
    torch.manual_seed(2)
    encoder = nn.Linear(64, 64)
    optimizer = torch.optim.SGD([*encoder.parameters(), *model.parameters()], lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(4):
        h = encoder(torch.randn(8, 128, 64, generator=generator))
        with wrap():
            loss = model(h)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = [p.detach().clone() for p in [*encoder.parameters(), *model.parameters()]]
    return losses, weights


@pytest.mark.parametrize("policy", ["auto", "recompute"])
def test_an_input_from_the_user_s_own_graph_is_not_backed_through_by_planning(
    policy: str,
) -> None:
    """The steps planning runs aside stop at the model's inputs: the encoder's graph is
    neither run a second time (freed: an error) nor given a second gradient."""
    plain = _upstream(_Net(), nullcontext)
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy=policy)
    assert _equal(plain, _upstream(model, lambda: off))
    assert off.stats()["planned_shape"] is not None


@pytest.mark.parametrize("on_infeasible", ["error", "recompute-all"])
def test_blocks_unfrozen_beyond_the_run_s_budget_say_so_or_recompute_as_chosen(
    on_infeasible: str,
) -> None:
    """The budget was resolved while two blocks were frozen (1/1.5 of that run's peak);
    unfrozen, their gradients and optimizer state need more than it even with every layer
    recomputed: the refusal says so (not a footprint ratio the user already gave), or
    every layer is recomputed beyond the budget with a warning, as chosen."""
    model = _Net(frozen=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    off = offload(model, footprint_ratio=1.5, optimizer=optimizer, on_infeasible=on_infeasible)
    said = "with policy auto, more than the run's budget .* trainable parameters"
    if on_infeasible == "error":
        with pytest.raises(ConfigError, match=said):
            _unfreezing(model, off, optimizer, unfreeze_at=3)
        return
    plain_model = _Net(frozen=2)
    plain, _ = _unfreezing(
        plain_model, None, torch.optim.AdamW(plain_model.parameters(), lr=1e-3), unfreeze_at=3
    )
    with pytest.warns(RuntimeWarning, match=said):
        ours, _ = _unfreezing(model, off, optimizer, unfreeze_at=3)
    assert _equal(ours, plain)


def test_a_step_holding_what_its_plan_did_not_see_is_said() -> None:
    """A gradient penalty, added after the first step (which offload learns), runs a
    second backward through the graph, which no plan's profile sees: a step read by
    check_memory=True that held more than the budget is said, once, naming what such
    steps hold."""
    model = _Net()
    off = offload(model, footprint_ratio=1.5, policy="recompute", check_memory=True)
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.warns(RuntimeWarning, match="over the run's budget .*gradient penalty"):
        for step in range(4):
            x = torch.randn(8, 128, 64, generator=generator, requires_grad=True)
            with off:
                loss = model(x)
            if step == 0:
                loss.backward()
            else:
                (grad,) = torch.autograd.grad(loss, x, create_graph=True)
                (loss + grad.pow(2).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
    stats = off.stats()
    assert stats["step_peak_bytes"] > 1.02 * stats["budget_bytes"]


class _DropoutNet(_Net):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.drop(block(x))
        return self.head(x).pow(2).mean()


def _evaluating_after_the_first_step(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]], *, evaluate: bool
) -> Result:
    """A validation loss in eval mode with gradients left on (no torch.no_grad) after the
    first step: the forward in which offload plans the first step's training shape."""

    def validate(step: int, losses: list[float]) -> None:
        if step == 0 and evaluate:
            model.eval()
            with wrap():
                losses.append(model(torch.randn(8, 128, 64)).item())
            model.train()

    return _plain_steps(model, wrap, validate)


def test_a_training_shape_planned_in_an_eval_forward_is_measured_in_train_mode() -> None:
    """The step run aside to plan a shape runs in the modes (and autocast) of the call
    that shape was learnt in, not of the forward it is planned in: dropout's masks are
    named, the budget is the training step's, and each step holds it."""
    budgets, unmatched = [], []
    for evaluate in (False, True):
        model = _DropoutNet()
        off = offload(model, footprint_ratio=1.5, check_memory=True)
        got = _evaluating_after_the_first_step(model, lambda off=off: off, evaluate=evaluate)
        stats = off.stats()
        off.close()
        plain = _evaluating_after_the_first_step(_DropoutNet(), nullcontext, evaluate=evaluate)
        assert _equal(got, plain)
        budgets.append(stats["budget_bytes"])
        unmatched.append(stats["unmatched_tensors"])
        assert stats["step_peak_bytes"] <= 1.02 * stats["budget_bytes"]
    assert budgets[0] == budgets[1]
    assert unmatched == [0, 0]


class _LogitsLM(nn.Module):
    """A user's LM that returns logits; the loop scores them with its own loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1024, 64)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(64, 1024)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _two_optimizers(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]], given: Any
) -> tuple[Result, list[float]]:
    """The body trained by AdamW, the head by SGD with momentum, the loss the loop's own;
    each step's peak as offload's check_memory reads it (``given``: the offload, or None)."""
    body = [p for name, p in model.named_parameters() if not name.startswith("head")]
    optimizers = [
        torch.optim.AdamW(body, lr=1e-3),
        torch.optim.SGD(model.head.parameters(), lr=1e-2, momentum=0.9),
    ]
    off = None if given is None else given(model, optimizers)
    generator = torch.Generator().manual_seed(1)
    losses, peaks = [], []
    for _ in range(5):
        ids = torch.randint(0, 1024, (4, 64), generator=generator)
        with wrap() if off is None else off:
            logits = model(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        del logits
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        stats = {} if off is None else off.stats()
        if stats.get("budget_bytes"):  # (none before the first plan)
            peaks.append(stats["step_peak_bytes"] / stats["budget_bytes"])
    return (losses, [p.detach().clone() for p in model.parameters()]), peaks


def test_every_optimizer_the_loop_steps_is_counted_and_its_own_loss_too() -> None:
    """Two optimizers given as a list: their state, and each one's step, are counted; a
    model that returns logits is measured with its loss's saved tensors stood in for (as
    large as the logits): every step after the learnt one holds the budget."""
    plain, _ = _two_optimizers(_LogitsLM(), nullcontext, None)
    got, peaks = _two_optimizers(
        _LogitsLM(),
        nullcontext,
        lambda model, opts: offload(model, footprint_ratio=1.15, optimizer=opts, check_memory=True),
    )
    assert _equal(plain, got)
    assert len(peaks) == 4 and max(peaks[1:]) <= 1.02, peaks


def test_what_offload_is_given_as_the_optimizer_is_checked_when_it_is_called() -> None:
    model = _LogitsLM()
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'"):
        offload(model, optimizer="lion")
    with pytest.raises(ConfigError, match=r"optimizer is a dict: .*a list of them"):
        offload(model, optimizer={"body": torch.optim.SGD(model.parameters())})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"optimizer is an empty list: pass the optimizer"):
        offload(model, optimizer=[])
    with pytest.warns(RuntimeWarning, match="3 trainable parameters .* in no optimizer"):
        offload(model, optimizer=torch.optim.SGD(model.blocks.parameters()))


def _with_a_target_forward(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]
) -> Result:
    """A consistency loss: the training forward, then a no_grad forward of the same model on
    another view (its target), then the backward."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        x, view = torch.randn(2, 8, 128, 64, generator=generator)
        with wrap():
            out = model(x)
        with torch.no_grad():
            target = model(view)
        loss = (out - target) ** 2
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_no_grad_forward_between_a_forward_and_its_backward_is_not_the_one_learnt() -> None:
    """The learnt step's layer hooks are on until the next forward offload runs: a forward
    under no_grad before the backward (or any after the timed one) is not timed again,
    which had left no layer with saved tensors to plan ("a footprint ratio of at most 1")."""
    plain = _with_a_target_forward(_Net(), nullcontext)
    model = _Net()
    off = offload(model, footprint_ratio=1.4)
    assert _equal(_with_a_target_forward(model, lambda: off), plain)
    stats = off.stats()
    assert stats["plans"] == 1 and stats["learning_steps"] == 1 and stats["swapped_bytes"] > 0


def _frozen_every_other_call(
    model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]
) -> Result:
    """A GAN's discriminator: trained on one call, frozen (requires_grad_(False)) for the
    other, whose backward runs on to its input (the generator's output)."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, inputs = [], []
    for _ in range(4):
        with wrap():
            loss = model(torch.randn(8, 128, 64, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.requires_grad_(False)
        x = torch.randn(8, 128, 64, generator=generator, requires_grad=True)
        with wrap():
            frozen = model(x)
        frozen.backward()
        model.requires_grad_(True)
        losses += [loss.item(), frozen.item()]
        inputs.append(x.grad)
    return losses, [p.detach().clone() for p in model.parameters()] + inputs


def test_a_model_frozen_for_every_other_call_runs_a_plan_in_both() -> None:
    """Each set of trainable parameters has plans of its own (a call's signature holds it):
    the step learnt in one set is planned in it, whatever the next call's set, where it
    had been let go of at every call, and no call ever ran a plan."""
    plain = _frozen_every_other_call(_Net(), nullcontext)
    model = _Net()
    off = offload(model, footprint_ratio=1.4)
    assert _equal(_frozen_every_other_call(model, lambda: off), plain)
    stats = off.stats()
    assert (stats["plans"], stats["learning_steps"], stats["steps"]) == (2, 2, 6)
    assert stats["swapped_bytes"] > 0


def test_a_model_that_runs_forwards_only_with_gradients_on_is_said_to_run_no_plan() -> None:
    """A frozen teacher called with gradients on, its output detached: no backward ever
    reaches its layers, so no call of it can be planned; a warning says so, and what to
    do, where each call had silently been learnt again."""
    teacher = _Net()
    teacher.requires_grad_(False)
    off = offload(teacher, footprint_ratio=1.4)
    x = torch.randn(8, 128, 64, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="ran no backward between two of its learnt calls"):
        for _ in range(3):
            with off:
                teacher(x).detach()
    assert off.stats()["plans"] == 0


class _Looped(_Net):
    """The stack run twice a forward (a looped, weight-shared depth)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return self.head(x).pow(2).mean()


def _looped_steps(model: nn.Module, wrap: Callable[[], AbstractContextManager[Any]]) -> Result:
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(4):
        with wrap():
            loss = model(torch.randn(8, 128, 64, generator=generator))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["auto", "disjoint"])
def test_layers_a_forward_runs_twice_are_not_taken_for_a_retained_graph(policy: str) -> None:
    """A layer's backward is done at its first run's: the backward of its second run (the
    first to come) had put its first run's swapped tensors back to the host, and warned of
    backward(retain_graph=True), which the loop never called."""
    plain = _looped_steps(_Looped(), nullcontext)
    model = _Looped()
    off = offload(model, footprint_ratio=1.3, policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _equal(plain, _looped_steps(model, lambda: off))
    assert off.stats()["swapped_bytes"] > 0
    off.close()


class _InPlace(_Net):
    """Changes each block's output in place after the block saved it (tanh saves it)."""

    changing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
            if self.changing:
                x.mul_(2)
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("policy", ["auto", "hybrid", "save-on-cpu"])
@pytest.mark.parametrize("from_step", [0, 2])
def test_a_saved_tensor_changed_in_place_is_refused_as_autograd_refuses_it(
    policy: str, from_step: int
) -> None:
    """Without pipeswap autograd refuses the backward; under offload it ran, reading the
    changed tensor (gradients 3.4e-2 off), in the learnt step and in planned ones."""
    model = _InPlace()
    model.changing = True
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(8, 128, 64)).backward()
    model = _InPlace()
    off = offload(model, footprint_ratio=1.5, policy=policy)
    for step in range(3):
        model.changing = step >= from_step
        with off:
            loss = model(torch.randn(8, 128, 64))
        if not model.changing:
            loss.backward()
            continue
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        break
    off.close()
