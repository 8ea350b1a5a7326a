"""Each stage's device meter: over its first steps, what the stage holds, a message counted on
the stage it is sent to, and the figures in the result and the report.

Covers: pipeswap/pipeline/stage_meter.py (and its use in pipeswap/pipeline/emulator.py,
pipeswap/pipeline/runtime.py and pipeswap/pipeline/result.py). Stages that swap, held to
their budget by this meter: tests/training/test_pipeline_stage_swaps.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support import pipeline_run

from pipeswap.pipeline import emulator
from pipeswap.pipeline.emulator import Emulator, MailboxTransport
from pipeswap.pipeline.resolve import resolve_pipeline
from pipeswap.pipeline.result import NOTES
from pipeswap.pipeline.stage_meter import StageMeter, metered_steps
from pipeswap.schedule.actions import Action, ActionKind
from pipeswap.train_config import TrainConfig


def _config(stages: int = 2, steps: int = 4, **fields: Any) -> TrainConfig:
    balance = {2: (2, 2), 4: (1, 1, 1, 1)}[stages]
    given = {"seq_len": 16, "micro_batches": 2, **fields}
    return resolve_pipeline(pipeline_run("gpt2-micro", balance, batch=4, steps=steps, **given))


def test_a_stage_meters_until_its_units_in_flight_filled_then_one_step_more() -> None:
    assert metered_steps(_config(2, steps=10)) == 2  # 1F1B: full in its first step
    assert metered_steps(_config(4, steps=10, micro_batches=1, schedule="async-1f1b")) == 5
    assert metered_steps(_config(2, steps=1)) == 1


def _stage(params: int = 256) -> Any:
    """What a StageMeter reads of a stage: its module, optimizers and device."""
    module = torch.nn.Linear(params // 4, 1, bias=False)
    weights = SimpleNamespace(optimizer=None, shared_optimizers={})
    return SimpleNamespace(module=module, weights=weights, device=torch.device("cpu"))


def test_the_meter_holds_the_weights_counts_actions_and_stops_after_the_last_update() -> None:
    stage = _stage(256)
    meter = StageMeter(stage, steps=1)
    assert meter.peak_bytes == 256  # the weights, held from the start
    kept = []
    with meter.action(Action(0, ActionKind.F, 0)):
        kept.append(torch.ones(64))  # 256 bytes the stage holds on
        torch.ones(1024)  # 4096 bytes, let go at once
    assert meter.meter.current == 512 and meter.peak_bytes == 512 + 4096
    with meter.action(Action(0, ActionKind.UPDATE, 0)):  # the last metered step's end
        pass
    assert not meter.metering
    with meter.action(Action(0, ActionKind.F, 1)):
        kept.append(torch.ones(10_000))  # after metering: not seen
    assert meter.peak_bytes == 512 + 4096


def test_a_message_counts_on_the_stage_it_is_sent_to_from_when_it_is_sent() -> None:
    stages = [_stage(), _stage()]
    meters = [StageMeter(stage, steps=1) for stage in stages]
    mailbox: dict[Any, Any] = {}
    sender = MailboxTransport(0, mailbox, meters)
    activation = torch.ones(256)  # 1 KiB
    with meters[0].action(Action(0, ActionKind.SEND_F, 0)):
        sender.send(ActionKind.F, 0, (activation,))
    assert meters[0].meter.current == 256 and meters[0].peak_bytes == 256  # the weights
    assert meters[1].meter.current == 256 + 1024
    MailboxTransport(1, mailbox, meters).take(ActionKind.F, 0)  # the receiver's, until freed
    assert meters[1].meter.current == 256


def test_an_emulated_stage_s_first_steps_read_its_steady_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _config(2, steps=4)
    first = Emulator(config, record=False).run()
    assert len(first.peak_resident_bytes) == 2
    monkeypatch.setattr(emulator, "metered_steps", lambda config: config.steps)
    whole = Emulator(config, record=False).run()
    assert whole.peak_resident_bytes == first.peak_resident_bytes  # no step holds more
    assert all(peak > 0 for peak in first.peak_resident_bytes)
    # The emulator's record of the weights each pass saw is its own, not the stages'.
    recorded = Emulator(config, record=True).run()
    assert recorded.peak_resident_bytes == first.peak_resident_bytes
    report = recorded.to_report()
    assert report["peak_resident_bytes"] == list(first.peak_resident_bytes)
    assert report["notes"] == NOTES
