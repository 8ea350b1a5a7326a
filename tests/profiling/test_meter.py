"""pipeswap/profiling/meter.py: the live storages, counted as torch's MemTracker counts them."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pipeswap.profiling.meter import (
    DeviceMeter,
    MemoryMarks,
    StorageMeter,
    held_tensors,
    host_buffer,
    unmetered,
)

transformers = pytest.importorskip("transformers")


def _llama(checkpointing: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_peak_is_memtracker_s_to_the_byte(checkpointing: bool) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _llama(checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, 32))
    _step(model, opt, ids)  # the optimizer's state exists from here on, for both meters
    tracker = MemTracker()
    tracker.track_external(model, opt, ids)
    with tracker:
        _step(model, opt, ids)
    theirs = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    with StorageMeter(holding=(model, opt, ids)) as meter:
        _step(model, opt, ids)
    assert meter.peak == theirs
    assert meter.current == sum(t.untyped_storage().nbytes() for t in held_tensors(model, opt, ids))


def test_what_is_excluded_never_counts_and_freed_storages_leave() -> None:
    pool = torch.empty(1 << 20, dtype=torch.uint8)  # a host pool: never the device's
    with StorageMeter(exclude=(pool,)) as meter:
        a = torch.ones(1000)  # 4000 bytes
        pool[:10].copy_(a[:10].to(torch.uint8))  # the copy's source (10 bytes) is freed
        assert meter.current == 4000
        del a
        assert meter.current == 0
    assert meter.peak == 4000 + 10


def test_a_host_buffer_and_unmetered_work_never_count() -> None:
    with StorageMeter() as meter:
        pool = host_buffer(1 << 20)  # made inside the meter, yet host memory
        pool[:8].copy_(torch.arange(8, dtype=torch.uint8))  # 8 bytes of source, freed
        assert pool.numel() == 1 << 20 and meter.current == 0
        with unmetered():
            record = torch.ones(1000)  # bookkeeping, not training's
        record.add_(1)  # an in-place op hands back the same storage: counted from then on
        kept = torch.ones(10)
        assert meter.current == 4000 + 40
        del record, kept
    assert meter.peak == 4000 + 40
    assert host_buffer(0).numel() == 0


def test_marks_file_each_interval_s_peak() -> None:
    meter = DeviceMeter("cpu")
    with meter:
        marks = MemoryMarks(meter)
        a = torch.ones(250)  # 1000 bytes
        del a
        marks.close("first")
        b = torch.ones(500)  # 2000 bytes
        marks.close("second")
        del b
    assert marks.peaks == {"first": 1000, "second": 2000}
    assert meter.name == "storages"


def test_a_count_paused_under_a_mode_entered_after_it_leaves_that_mode_on() -> None:
    """offload's count spans the caller's code (a forward to its backward's end): a meter
    the caller entered since, and still has on, keeps counting once the count stops."""
    first, second = DeviceMeter("cpu"), DeviceMeter("cpu")
    first.resume()
    second.resume()
    first.pause()
    kept = torch.ones(256)  # 1 KiB made after the first count stopped
    assert first.current == 0
    assert second.current == kept.nbytes
    second.pause()
    assert _get_current_dispatch_mode_stack() == []
