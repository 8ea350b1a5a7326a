"""pipeswap/pipeline/shapes.py: what crosses each cut for a batch of any shape, traced."""

from __future__ import annotations

import pytest
import torch
from support import pipeline_run
from torch import nn

from pipeswap.models.adapt import adapt
from pipeswap.models.base import evaluating
from pipeswap.pipeline.job import build_full_model
from pipeswap.pipeline.shapes import BatchShapes, boundary_specs
from pipeswap.pipeline.stage import layer_infos
from pipeswap.precision import autocast
from pipeswap.schedule.actions import ActionKind


def _real(model: nn.Module, sample: torch.Tensor, precision: str) -> list[object]:
    with torch.no_grad(), evaluating(model), autocast(precision, "cpu"):
        return [info.output for info in layer_infos(model, sample, "model")]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("length", [5, 16])
def test_traced_specs_are_a_real_forward_s(precision: str, length: int) -> None:
    model = build_full_model(pipeline_run("gpt2-micro", (2, 2), batch=4, seq_len=16))
    sample = torch.randint(0, 64, (2, length))
    assert boundary_specs(model, sample, precision) == _real(model, sample, precision)


class DataDependent(nn.Module):
    """A block whose output shape depends on the data: fake tensors cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = int((x[0, :, 0] > -1e9).sum().item())
        return x[:, :keep]


def test_a_model_fake_tensors_cannot_trace_runs_for_real() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4), DataDependent(), DataDependent(), nn.Linear(4, 10))
    sample = torch.randint(0, 10, (2, 7))
    specs = boundary_specs(net, sample, "fp32")
    assert specs == _real(net, sample, "fp32") and specs[1].tensors[0].shape == (2, 7, 4)


class Recording:
    def __init__(self) -> None:
        self.expected: dict[tuple[ActionKind, int], object] = {}

    def expect(self, direction: ActionKind, unit: int, spec: object) -> None:
        self.expected[(direction, unit)] = spec


def test_a_middle_stage_expects_each_new_shape_once_traced() -> None:
    config = pipeline_run("gpt2-micro", (1, 2, 1), batch=4, seq_len=16)
    model = adapt(build_full_model(config))
    first = torch.randint(0, 64, (4, 16))
    shapes = BatchShapes(model, (1, 3), 1, 3, 2, "fp32", first)
    transport = Recording()
    shapes.expect(transport, first, 0)
    assert transport.expected == {}  # the first batch's are the transport's own specs
    other = torch.randint(0, 64, (2, 9))
    shapes.expect(transport, other, 6)
    specs = _real(model, other[:1], "fp32")
    assert set(transport.expected) == {(k, u) for k in (ActionKind.F, ActionKind.B) for u in (6, 7)}
    assert transport.expected[(ActionKind.F, 6)] == specs[0]
    assert transport.expected[(ActionKind.B, 7)] == specs[2]
    assert len(shapes.traced) == 1
