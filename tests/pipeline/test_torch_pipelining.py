"""Our gpipe/1f1b give the same gradients as torch.distributed.pipelining's schedules."""

from __future__ import annotations

import pytest
import torch
from support import pipeline_run
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    SplitPoint,
    pipeline,
)

from pipeswap.config_fields import replace_fields
from pipeswap.dist.group import single_threaded
from pipeswap.dist.launch import spawn
from pipeswap.pipeline.emulator import Emulator
from pipeswap.pipeline.job import BatchSource, build_full_model
from tests.models.hf_configs import hf_config

pytestmark = pytest.mark.dist

CONFIG = pipeline_run("gpt2-micro", (2, 2), batch=8, seq_len=16, steps=1, micro_batches=4)


def _torch_gradients(rank: int, world: int, schedules: list[str]) -> dict[str, list[torch.Tensor]]:
    """Gradients of this rank's stage after one step of each torch schedule."""
    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    out = {}
    with single_threaded():
        for name in schedules:
            model = build_full_model(CONFIG)
            start = sum(CONFIG.require_pipeline().stage_balance[:rank])
            stage_module = model.stage(start, start + CONFIG.require_pipeline().stage_balance[rank])
            x, y = BatchSource(CONFIG, model).batch(0)
            micro = CONFIG.micro_batch_size
            # Shapes up front: gloo cannot complete the shape inference exchange (notes.md).
            with torch.no_grad():
                boundary = model.stage(0, CONFIG.require_pipeline().stage_balance[0])(x[:micro])
                logits = model(x[:micro])
            # The example input must require grad, or stage 1 sends no input gradients.
            boundary.requires_grad_(True)
            stage = PipelineStage(
                stage_module,
                rank,
                world,
                torch.device("cpu"),
                input_args=(x[:micro],) if rank == 0 else (boundary,),
                output_args=boundary if rank == 0 else logits,
            )
            schedule = classes[name](
                stage, CONFIG.require_pipeline().micro_batch_count, loss_fn=model.loss
            )
            if rank == 0:
                schedule.step(x.contiguous())
            else:
                schedule.step(target=y.contiguous(), losses=[])
            out[name] = [p.grad.detach().clone() for p in stage_module.parameters()]
    return out


def test_same_gradients_as_torch_schedules() -> None:
    schedules = ["gpipe", "1f1b"]
    launched = spawn(_torch_gradients, 2, schedules, timeout_s=60)
    assert launched.ok, launched.exit_codes
    for name in schedules:
        emulator = Emulator(replace_fields(CONFIG, schedule=name), keep_gradients=True)
        emulator.run()
        for rank, executor in enumerate(emulator.executors):
            ours = executor.weights.last_gradients
            theirs = launched.results[rank][name]
            assert ours is not None and len(ours) == len(theirs) > 0
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
            assert any(b.abs().max() > 0 for b in theirs)


def test_torch_pipelining_split_copies_tied_weights_and_fixes_shapes() -> None:
    """Why pipeswap cuts Hugging Face models by replay, not with pipelining's tracer
    (docs/concepts.md, "Your model, as it is"): the traced stages hold their own copy of
    a weight tied across them, and run only the shapes they were traced at."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(hf_config("gpt2"))
    ids = torch.randint(0, 256, (2, 16))
    split = pipeline(
        model,
        mb_args=(),
        mb_kwargs={"input_ids": ids, "use_cache": False},
        split_spec={"transformer.h.1": SplitPoint.BEGINNING},
    )
    first, last = split.get_stage_module(0), split.get_stage_module(1)
    tied = dict(first.named_parameters()).keys() & dict(last.named_parameters()).keys()
    assert tied == {"lm_head.weight"}
    copies = [dict(stage.named_parameters())["lm_head.weight"] for stage in (first, last)]
    assert copies[0] is not copies[1]  # two tensors, nothing keeps their updates equal
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        first(torch.randint(0, 256, (4, 16)))  # another micro-batch size
