"""Mixed precision: autocast by name, fp16's loss scale, and what each mode keeps in every
precision (swapping bit-identical to none, the pipeline runtime to the emulator).

Covers: pipeswap/precision.py and its use in pipeswap/training, pipeswap/pipeline and
`pipeswap profile`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeswap.config_fields import ConfigError
from pipeswap.data_config import DataConfig
from pipeswap.optim import OptimizerConfig
from pipeswap.pipeline.stage import inspect_layers
from pipeswap.precision import (
    PRECISIONS,
    LossScaler,
    autocast,
    autocast_dtype,
    drop_cached_casts,
)
from pipeswap.profiling.measure import measure
from pipeswap.schedule.pipeline_config import PipelineConfig
from pipeswap.swap.swap_config import SwapConfig
from pipeswap.train_config import TrainConfig
from pipeswap.training.run import train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_precision_autocasts_a_matrix_product_to_its_dtype() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    found = {}
    for precision in PRECISIONS:
        with autocast(precision, "cpu"):
            found[precision] = layer(x).dtype
    assert found == {
        "fp32": torch.float32,
        "bf16-mixed": torch.bfloat16,
        "fp16-mixed": torch.float16,
    }
    assert autocast_dtype("fp32") is None


def _weight_cast(output: torch.Tensor, weight: torch.Tensor) -> object:
    """The autograd node of the cast of ``weight`` that ``output`` was computed from."""
    nodes = [output.grad_fn]
    while nodes:
        node = nodes.pop()
        if type(node).__name__ == "ToCopyBackward0":
            source = node.next_functions[0][0]
            if getattr(source, "variable", None) is weight:
                return node
        nodes.extend(n for n, _ in node.next_functions if n is not None)
    raise AssertionError("no cast of the weight")


def test_a_layer_s_edge_lets_go_of_the_cached_casts_and_keeps_the_cache_on() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, again = layer(x), layer(x)
        # Cached: both products read one cast of the weight (one autograd node).
        assert _weight_cast(first, layer.weight) is _weight_cast(again, layer.weight)
        drop_cached_casts()
        assert torch.is_autocast_cache_enabled()  # as the user set it
        after = layer(x)
        assert _weight_cast(after, layer.weight) is not _weight_cast(first, layer.weight)
        assert torch.equal(after, first)  # a new cast of the same values


def test_an_unknown_precision_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="use one of fp32, bf16-mixed, fp16-mixed"):
        TrainConfig("gpt2-tiny", precision="bf16")


def test_fp16_is_refused_for_pipelines_and_says_what_works() -> None:
    with pytest.raises(ConfigError, match="precision bf16-mixed"):
        TrainConfig("gpt2-tiny", precision="fp16-mixed", pipeline=PipelineConfig(stages=2))


def test_the_loss_scaler_skips_a_step_whose_gradients_overflowed() -> None:
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = LossScaler("fp16-mixed", torch.device("cpu"))
    start = scaler.state_dict()["scale"]
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.unscale(optimizer)
    scaler.step(optimizer)
    assert torch.equal(weight.detach(), torch.ones(3))  # skipped
    assert scaler.state_dict()["scale"] == start / 2
    plain = LossScaler("bf16-mixed", torch.device("cpu"))
    loss = torch.tensor(2.0)
    assert plain.scale(loss) is loss and plain.state_dict() == {}


def test_the_profile_sees_the_half_precision_bytes_autocast_saves() -> None:
    plain = measure("gpt2-tiny", 4, seq_len=32, repeats=1, warmup=0)
    with autocast("bf16-mixed", "cpu"):
        mixed = measure("gpt2-tiny", 4, seq_len=32, repeats=1, warmup=0)
    assert mixed.notes["autocast"] == "bfloat16" and plain.notes["autocast"] is None
    # Matrix products save bf16 copies (of their inputs and of the weights autocast cast);
    # LayerNorm, softmax and the loss keep float32: 0.78x for gpt2-tiny, not 0.5x.
    ratio = mixed.saved_bytes / plain.saved_bytes
    assert 0.5 < ratio < 0.85


def _run(precision: str, **changes: object) -> tuple[list[float], str]:
    config = TrainConfig(
        "gpt2-tiny",
        batch=4,
        seq_len=32,
        steps=3,
        device="cpu",
        precision=precision,
        progress=False,
        # The footprint ratios below were set for SGD's one state buffer.
        optim=OptimizerConfig(optimizer="sgd"),
        **changes,  # type: ignore[arg-type]
    )
    outcome = train(config)
    assert outcome is not None
    return outcome.report.losses, outcome.report.params_sha256


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_swapping_trains_bit_for_bit_like_no_swapping_in_mixed_precision(precision: str) -> None:
    none = _run(precision, swap=SwapConfig(policy="none"))
    swapped = _run(precision, swap=SwapConfig(policy="hybrid", footprint_ratio=1.25))
    assert swapped == none
    assert none != _run("fp32", swap=SwapConfig(policy="none"))  # autocast did change the math


def test_a_profile_of_another_precision_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fp32.json"
    measure("gpt2-tiny", 4, seq_len=32, repeats=1, warmup=0).save(path)
    with pytest.raises(ConfigError, match="profile it with --precision bf16-mixed"):
        _run("bf16-mixed", profile_path=str(path))


def test_pipeline_boundaries_carry_the_dtype_autocast_gives_them() -> None:
    config = TrainConfig(
        "resnet-micro", batch=4, precision="bf16-mixed", pipeline=PipelineConfig(stages=2)
    ).resolved()
    dtypes = {t.dtype for info in inspect_layers(config) for t in info.output.tensors}
    assert dtypes == {torch.bfloat16}  # convolutions' outputs: the meta pass says float32


@pytest.mark.parametrize("model", ["gpt2-tiny", "resnet-micro"])
def test_the_pipeline_runtime_equals_the_emulator_in_bf16(model: str) -> None:
    def run(**pipeline: object) -> tuple[list[float], str]:
        config = TrainConfig(
            model,
            batch=4,
            steps=2,
            precision="bf16-mixed",
            progress=False,
            nproc=None if pipeline.get("emulate") else 2,
            pipeline=PipelineConfig(stages=2, schedule="1f1b", **pipeline),  # type: ignore[arg-type]
        )
        outcome = train(config)
        assert outcome is not None
        return outcome.report.losses, outcome.report.params_sha256

    assert run(emulate=True) == run()


def test_on_your_own_data_in_bf16_swapping_and_the_runtime_change_nothing(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox {i * 7 % 13}\n" for i in range(800)))
    data = DataConfig(data=str(corpus))
    none = _run("bf16-mixed", swap=SwapConfig(policy="none"), dataset=data)
    swapped = _run(
        "bf16-mixed", swap=SwapConfig(policy="hybrid", footprint_ratio=1.25), dataset=data
    )
    assert swapped == none
    assert none != _run("bf16-mixed", swap=SwapConfig(policy="none"))  # it read the file

    def pipeline(**fields: object) -> tuple[list[float], str]:
        stages = PipelineConfig(stages=2, schedule="1f1b", **fields)  # type: ignore[arg-type]
        return _run("bf16-mixed", pipeline=stages, dataset=data)

    assert pipeline(emulate=True) == pipeline()
