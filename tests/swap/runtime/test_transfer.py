"""SwapTransfer's stream and event discipline, checked on the CPU with a recording fake of CUDA.

The fake stands in for pipeswap.streams inside pipeswap.swap.runtime.transfer: it logs every stream
wait, event record, event synchronize and byte copy (with the stream it was issued on),
and its events complete only when a test says so (or after a set number of queries). So the
ordering rules a GPU relies on, which CPU no-op streams can never break, are asserted here.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import pytest
import torch
from fake_cuda import FakeCuda, FakeEvent, FakeStream

from pipeswap.models import build_model
from pipeswap.swap.plan import GpuPlan, SwapDecision, SwapPlan
from pipeswap.swap.runtime.capture import capture_records
from pipeswap.swap.runtime.executor import SwapExecutor
from pipeswap.swap.runtime.pool import HostPool
from pipeswap.swap.runtime.transfer import (
    BACK,
    COPYING_OUT,
    FETCHING,
    GONE,
    ON_HOST,
    DeviceLedger,
    SavedTensorState,
    SwapTransfer,
    bytes_of_storage,
)

CPU = torch.device("cpu")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    return cuda


def _setup(
    fake: FakeCuda, sizes: dict[str, int]
) -> tuple[SwapTransfer, DeviceLedger, dict[str, SavedTensorState], dict[str, torch.Tensor]]:
    """A transfer over a pool with one region per name, and a saved tensor per name."""
    pool = HostPool(sizes.items())
    ledger = DeviceLedger()
    moved = SwapTransfer(pool, CPU, ledger)
    tensors, entries = {}, {}
    for number, (key, nbytes) in enumerate(sizes.items()):
        tensors[key] = torch.arange(nbytes // 4, dtype=torch.float32) + 1000 * number
        entries[key] = _entry(key, tensors[key], ledger)
    return moved, ledger, entries, tensors


def _entry(key: str, tensor: torch.Tensor, ledger: DeviceLedger) -> SavedTensorState:
    storage = bytes_of_storage(tensor)
    ledger.grow(storage.numel())
    return SavedTensorState(key, storage.numel(), True, storage)


def _events(fake: FakeCuda, stream: FakeStream) -> list[FakeEvent]:
    return [item[2] for item in fake.log if item[0] == "record" and item[1] is stream]


def test_swap_out_waits_for_the_producer_and_keeps_the_bytes_until_its_event(
    fake: FakeCuda,
) -> None:
    moved, ledger, entries, tensors = _setup(fake, {"a": 256})
    entry = entries["a"]
    device_bytes = entry.device
    moved.swap_out(entry)
    out, compute = moved.out_stream, fake.compute
    (event,) = _events(fake, out)
    assert fake.log == [
        ("wait_stream", out, compute),  # the producer of the tensor must have finished
        ("copy", out, "d2h", True),  # on the side stream, asynchronous
        ("record", out, event),
    ]
    assert entry.state == COPYING_OUT and entry.event is event
    for _ in range(3):  # the copy is still running: the device bytes must stay
        moved.poll()
        assert entry.device is device_bytes and ledger.live_bytes == 256
    event.done = True
    moved.poll()
    assert entry.state == ON_HOST and entry.device is None and entry.event is None
    assert ledger.live_bytes == 0
    assert torch.equal(moved.pool.region("a").view(torch.float32), tensors["a"])


def test_prefetch_runs_on_its_own_stream_and_compute_waits_for_it(fake: FakeCuda) -> None:
    moved, ledger, entries, tensors = _setup(fake, {"a": 256})
    entry = entries["a"]
    moved.swap_out(entry)
    _events(fake, moved.out_stream)[0].done = True
    moved.poll()
    fake.log.clear()
    assert moved.prefetch(entry) is True
    into, compute = moved.in_stream, fake.compute
    (event,) = _events(fake, into)
    assert into is not moved.out_stream
    assert fake.log == [
        ("wait_stream", into, compute),  # the fresh block may have been freed on compute
        ("copy", into, "h2d", True),
        ("record", into, event),
    ]
    assert entry.state == FETCHING and ledger.live_bytes == 256
    assert moved.ready(entry) is False  # not late: only an event to wait on
    assert fake.log[-1] == ("wait_event", compute, event)
    assert entry.state == BACK
    assert entry.device is not None
    assert torch.equal(entry.device.view(torch.float32), tensors["a"])
    moved.ready(entry)  # a second view of the same storage waits no more
    assert sum(1 for item in fake.log if item[0] == "wait_event") == 1


def test_a_late_fetch_is_a_blocking_copy_on_the_compute_stream(fake: FakeCuda) -> None:
    moved, ledger, entries, tensors = _setup(fake, {"a": 128})
    entry = entries["a"]
    moved.swap_out(entry)
    _events(fake, moved.out_stream)[0].done = True
    moved.poll()
    fake.log.clear()
    assert moved.ready(entry) is True
    assert fake.log == [("copy", fake.compute, "h2d", False)]
    assert entry.state == BACK and ledger.live_bytes == 128
    assert torch.equal(entry.device.view(torch.float32), tensors["a"])  # type: ignore[union-attr]


def test_a_prefetch_while_the_copy_out_runs_keeps_the_device_bytes(fake: FakeCuda) -> None:
    moved, ledger, entries, _ = _setup(fake, {"a": 64})
    entry = entries["a"]
    device_bytes = entry.device
    moved.swap_out(entry)
    (out_event,) = _events(fake, moved.out_stream)
    assert moved.prefetch(entry) is False
    assert entry.state == BACK and entry.device is device_bytes
    assert not any(item[0] == "copy" and item[2] == "h2d" for item in fake.log)
    out_event.done = True
    moved.poll()  # the copy finished, but the bytes are in use again: not released
    assert entry.device is device_bytes and ledger.live_bytes == 64
    moved.forget(entry)
    moved.forget(entry)
    assert entry.state == GONE and ledger.live_bytes == 0


def test_the_next_swap_out_into_a_slot_waits_for_the_prefetch_that_read_it(fake: FakeCuda) -> None:
    moved, ledger, entries, tensors = _setup(fake, {"a": 64, "b": 64})
    for key in ("a", "b"):
        moved.swap_out(entries[key])
    for event in _events(fake, moved.out_stream):
        event.done = True
    moved.poll()
    moved.prefetch(entries["a"])  # step 1 reads region a on the copy-in stream ...
    (read_a,) = _events(fake, moved.in_stream)
    moved.ready(entries["b"])  # ... and region b synchronously (late)
    fake.log.clear()
    # Step 2 saves new tensors under the same names: their copies reuse the regions.
    again = {key: _entry(key, tensors[key] * 2, ledger) for key in ("a", "b")}
    moved.swap_out(again["a"])
    out = moved.out_stream
    assert fake.log[:3] == [
        ("wait_stream", out, fake.compute),
        ("wait_event", out, read_a),  # region a is overwritten only after step 1 read it
        ("copy", out, "d2h", True),
    ]
    fake.log.clear()
    moved.swap_out(again["b"])  # a late fetch is already complete: nothing to wait on
    assert [item[0] for item in fake.log] == ["wait_stream", "copy", "record"]
    fake.log.clear()
    third = _entry("a", tensors["a"], ledger)
    with pytest.warns(UserWarning, match="two forwards before one backward"):
        moved.swap_out(third)  # step 2 has not read region a: no stale wait ...
    assert [item[0] for item in fake.log] == ["wait_stream", "copy", "record"]
    # ... but step 2's tensor, whose copy into region a is still running, keeps its bytes.
    assert again["a"].state == BACK and again["a"].device is not None


def test_a_region_a_backward_has_yet_to_read_is_not_written_over(fake: FakeCuda) -> None:
    """Two forwards before one backward: the second one's swap-out into a region brings the
    first one's tensor back to the device first (a blocking copy), never loses its bytes."""
    moved, ledger, entries, tensors = _setup(fake, {"a": 64})
    first = entries["a"]
    moved.swap_out(first)
    _events(fake, moved.out_stream)[0].done = True
    moved.poll()
    assert first.state == ON_HOST and ledger.live_bytes == 0
    fake.log.clear()
    second = _entry("a", tensors["a"] * 2, ledger)
    with pytest.warns(UserWarning, match="holds more than its plan's budget"):
        moved.swap_out(second)
    assert fake.log[0] == ("copy", fake.compute, "h2d", False)  # the first one, back first
    assert first.state == BACK and ledger.live_bytes == 128  # both on the device now
    assert torch.equal(first.device.view(torch.float32), tensors["a"])  # type: ignore[union-attr]
    assert moved.ready(first) is False and moved.rescued == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per transfer
        moved.swap_out(_entry("a", tensors["a"] * 3, ledger))
    assert second.state == BACK and moved.rescued == 2


def test_forgetting_bytes_a_copy_still_uses_synchronizes_first(fake: FakeCuda) -> None:
    moved, ledger, entries, _ = _setup(fake, {"a": 64, "b": 64})
    moved.swap_out(entries["a"])
    (out_event,) = _events(fake, moved.out_stream)
    moved.forget(entries["a"])  # autograd let go while the copy out still reads the bytes
    assert ("synchronize", out_event) in fake.log
    assert entries["a"].state == GONE and entries["a"].device is None
    assert ledger.live_bytes == 64
    moved.poll()  # the released entry is dropped from the queue, not released twice
    assert ledger.live_bytes == 64
    moved.swap_out(entries["b"])
    _events(fake, moved.out_stream)[-1].done = True
    moved.poll()
    moved.prefetch(entries["b"])
    (in_event,) = _events(fake, moved.in_stream)
    fake.log.clear()
    moved.forget(entries["b"])  # a prefetch nobody waited on: settle it before freeing
    assert fake.log == [("synchronize", in_event)]
    assert ledger.live_bytes == 0


def test_poll_releases_in_issue_order_up_to_the_first_unfinished_copy(fake: FakeCuda) -> None:
    moved, ledger, entries, _ = _setup(fake, {"a": 64, "b": 128, "c": 256})
    for key in ("a", "b", "c"):
        moved.swap_out(entries[key])
    first, second, third = _events(fake, moved.out_stream)
    first.done = third.done = True
    moved.poll()
    assert [entries[k].state for k in "abc"] == [ON_HOST, COPYING_OUT, COPYING_OUT]
    assert ledger.live_bytes == 128 + 256
    second.done = True
    moved.poll()
    assert ledger.live_bytes == 0


def test_making_room_waits_for_the_oldest_copies_until_the_budget_holds(fake: FakeCuda) -> None:
    """The forward waits for memory as the plan's timeline does: copies still running are
    waited for, oldest first, and released, until the device holds what the budget allows."""
    moved, ledger, entries, _ = _setup(fake, {"a": 64, "b": 128, "c": 256})
    for key in ("a", "b", "c"):
        moved.swap_out(entries[key])
    first, second, third = _events(fake, moved.out_stream)
    moved.make_room(lambda: ledger.live_bytes > 256)  # needs a and b released
    assert ("synchronize", first) in fake.log and ("synchronize", second) in fake.log
    assert ("synchronize", third) not in fake.log
    assert [entries[k].state for k in "abc"] == [ON_HOST, ON_HOST, COPYING_OUT]
    assert ledger.live_bytes == 256
    moved.make_room(lambda: True)  # over budget whatever happens: waits for every copy, then stops
    assert ledger.live_bytes == 0 and entries["c"].state == ON_HOST


# ---- a whole training step through the executor, with the recording fake ---------------
def _sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _train(kind: str | None) -> tuple[list[float], str, list[Any]]:
    torch.manual_seed(0)
    model = build_model("gpt2-tiny")
    batches = [model.example_batch(4, seq_len=16, seed=s) for s in range(3)]
    batches = [(x.clone(memory_format=torch.contiguous_format), y.clone()) for x, y in batches]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    executor = None
    if kind is not None:
        x0, y0 = batches[0]
        records, _ = capture_records(model, lambda: model.loss(model(x0), y0))
        names = list(model.layer_names)
        decisions = [
            SwapDecision(
                name,
                r.index,
                r.bytes,
                name,
                None if kind == "turn" else names[min(i + 1, len(names) - 1)],
            )
            for i, name in enumerate(names)
            for r in records[name]
        ]
        plan = SwapPlan(
            kind, model.name, tuple(names), (GpuPlan("gpu0", 0, 10**12, 0.0, tuple(decisions)),)
        )
        executor = SwapExecutor(model, plan)
    losses, stats = [], []
    for x, y in batches:
        if executor is None:
            loss = model.loss(model(x), y)
            loss.backward()
        else:
            loss, step = executor.train_step(lambda x=x, y=y: model.loss(model(x), y))
            stats.append(step)
            assert executor.live_bytes == 0
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, _sha256(model), stats


@pytest.mark.parametrize("kind", ["jit", "turn"])
def test_a_training_step_keeps_the_stream_rules_and_the_bits(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    expected = _train(None)[:2]
    cuda = FakeCuda(complete_after=1)  # every copy looks unfinished when first asked
    cuda.install(monkeypatch)
    losses, sha, stats = _train(kind)
    assert (losses, sha) == expected
    out, into = cuda.sides
    log = cuda.log
    copies = [i for i, item in enumerate(log) if item[0] == "copy"]
    assert copies
    waited = {id(item[2]) for item in log if item[0] == "wait_event" and item[1] is cuda.compute}
    for i in copies:
        _, stream, direction, non_blocking = log[i]
        if direction == "d2h":
            assert stream is out and non_blocking
            before = [item for item in log[:i] if item[1] is out][-1:]
            assert before and before[0][0] in ("wait_stream", "wait_event")
            assert ("wait_stream", out, cuda.compute) in log[max(0, i - 2) : i]
        elif non_blocking:  # a prefetch: ordered after compute, waited on before use
            assert stream is into and log[i - 1] == ("wait_stream", into, cuda.compute)
            assert log[i + 1][0] == "record" and id(log[i + 1][2]) in waited
        else:  # a late fetch: blocking, on the compute stream
            assert stream is cuda.compute
    assert any(item[2:] == ("h2d", True) for item in log if item[0] == "copy")
    assert sum(s.late_fetches for s in stats) == 0
    # A copy out still running at its prefetch point is not fetched: its bytes never left.
    assert all(0 < s.prefetched_bytes <= s.swapped_bytes for s in stats)


# ---- CUDA -------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_frees_memory_and_never_overwrites_a_slot_being_read() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = 64 << 20  # large, so a missing wait would let the copies race
    pool = HostPool([("a", nbytes)], pin=True)
    assert pool.pinned
    ledger = DeviceLedger()
    moved = SwapTransfer(pool, device, ledger)
    first = torch.rand(nbytes // 4, device=device)
    expected = first.cpu()
    entry = _entry("a", first, ledger)
    del first  # only the entry holds the bytes now
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    moved.swap_out(entry)
    assert entry.event is not None
    entry.event.synchronize()
    moved.poll()
    assert entry.state == ON_HOST and ledger.live_bytes == 0
    assert torch.cuda.memory_allocated(device) == before - nbytes  # released after the copy
    assert torch.equal(pool.region("a").view(torch.float32), expected)
    assert moved.prefetch(entry)
    # The next step's swap-out into the same region, issued while the prefetch may still run.
    second = torch.rand(nbytes // 4, device=device) + 2.0
    again = _entry("a", second, ledger)
    moved.swap_out(again)
    assert moved.ready(entry) is False
    torch.cuda.synchronize(device)
    assert entry.device is not None
    assert torch.equal(entry.device.view(torch.float32).cpu(), expected)
    assert torch.equal(pool.region("a").view(torch.float32), second.cpu())
    # A tensor of region ``a`` used before any prefetch: fetched there and then, complete.
    late = SavedTensorState("a", nbytes, True, None)
    late.state = ON_HOST
    assert moved.ready(late) is True
    assert late.device is not None
    assert torch.equal(late.device.view(torch.float32).cpu(), second.cpu())
