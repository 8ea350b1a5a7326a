"""Tests of meta-device estimates (pipeswap.profiling.estimate) against closed forms and CPU runs."""

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeswap.errors import PipeswapError
from pipeswap.hardware.gpus import gpu_spec
from pipeswap.models import model_spec
from pipeswap.models.base import LayeredModel
from pipeswap.profiling.estimate import Efficiency, estimate, meta_copy
from pipeswap.profiling.measure import measure
from tests.models.hf_configs import save_model

SMALL_MODELS = [
    ("gpt2-micro", {"seq_len": 16}),
    ("gpt2-tiny", {"seq_len": 32}),
    ("bert-micro", {"seq_len": 16}),
    ("resnet-micro", {"image_size": 32}),
    ("vgg-micro", {"image_size": 32}),
    ("vit-micro", {"image_size": 32}),
]


def _linear_model(width_in: int, width_out: int, device: str = "meta") -> LayeredModel:
    """flatten (a view), one bias-free Linear reading the images, a small head."""
    with torch.device(device):
        blocks = [
            ("pre", nn.Flatten()),
            ("lin", nn.Linear(width_in, width_out, bias=False)),
            ("out", nn.Linear(width_out, 4)),
        ]
    return LayeredModel("lin", blocks, "classify", num_classes=4, in_channels=width_in)


def test_flops_and_time_of_one_linear_in_closed_form() -> None:
    batch, width_in, width_out = 8, 256, 512
    profile = estimate(_linear_model(width_in, width_out), batch, image_size=1)
    lin = profile.layer("lin")
    matmul = 2 * batch * width_in * width_out
    assert lin.forward_flops == matmul
    # As in a real step, the images need no gradient: only the weight's is computed...
    assert lin.backward_flops == matmul
    # ...while the head's input (lin's output) needs one: input and weight gradients.
    head = profile.layer("out")
    assert head.backward_flops == 2 * head.forward_flops == 2 * (2 * batch * width_out * 4)
    eff, v100 = Efficiency(), gpu_spec("v100-32gb")
    moved = 4 * (batch * width_in + width_in * width_out + batch * width_out)
    compute_s = matmul / (v100.fp32_flops * eff.matmul)
    memory_s = moved / (v100.hbm_bytes_per_s * eff.memory)
    assert lin.forward_s == pytest.approx(max(compute_s, memory_s) + eff.launch_s, rel=1e-12)
    pre = profile.layer("pre")  # a view: no kernel, no cost
    assert (pre.forward_s, pre.backward_s, pre.forward_flops) == (0.0, 0.0, 0)


def test_bfloat16_runs_matmuls_at_the_tensor_core_peak() -> None:
    model = _linear_model(4096, 4096)
    fp32 = estimate(model, 4096, image_size=1, dtype="float32").layer("lin")
    bf16 = estimate(model, 4096, image_size=1, dtype="bfloat16").layer("lin")
    launch = Efficiency().launch_s
    v100 = gpu_spec("v100-32gb")
    ratio = (fp32.forward_s - launch) / (bf16.forward_s - launch)
    assert ratio == pytest.approx(v100.tensor_flops / v100.fp32_flops)  # compute-bound: 8x


def test_efficiency_is_recorded_and_applied() -> None:
    model = _linear_model(4096, 4096)
    slow = estimate(model, 4096, image_size=1, efficiency=Efficiency(matmul=0.3))
    fast = estimate(model, 4096, image_size=1, efficiency=Efficiency(matmul=0.6))
    launch = Efficiency().launch_s
    lin_slow, lin_fast = slow.layer("lin"), fast.layer("lin")
    assert (lin_slow.forward_s - launch) == pytest.approx(2 * (lin_fast.forward_s - launch))
    assert slow.notes["efficiency"] == {"matmul": 0.3, "memory": 0.7, "launch_s": 5e-6}
    assert slow.notes["gpu"]["name"] == "v100-32gb" and slow.source == "estimate"


@pytest.mark.parametrize("name, shape", SMALL_MODELS)
def test_saved_tensors_match_a_cpu_run_index_by_index(name, shape) -> None:
    estimated = estimate(name, 2, **shape)
    measured = measure(name, 2, warmup=0, repeats=1, **shape)
    assert estimated.layer_names == measured.layer_names
    for est, real in zip(estimated.layers, measured.layers):
        assert est.saved == real.saved, est.name
        assert (est.param_bytes, est.output_bytes) == (real.param_bytes, real.output_bytes)
    # "Real peak": the most bytes of distinct saved storages alive at once during a real
    # CPU forward + backward (pack hook +, garbage-collected saved slot -), tracked by
    # SavedTensorCapture; the estimate's resident activations are the sum of its saved bytes.
    real_peak = measured.notes["peak_live_saved_bytes"]
    assert abs(estimated.saved_bytes - real_peak) <= 0.10 * real_peak
    assert estimated.saved_bytes == real_peak  # in fact exact


def test_hand_model_saved_tensors_match_a_cpu_run() -> None:
    torch.manual_seed(0)
    cpu_model = _linear_model(6, 10, device="cpu")
    measured = measure(cpu_model, 3, image_size=1, warmup=0, repeats=1)
    estimated = estimate(meta_copy(cpu_model), 3, image_size=1)
    assert [la.saved for la in estimated.layers] == [la.saved for la in measured.layers]
    assert estimated.param_bytes == measured.param_bytes


def test_meta_copy_leaves_the_original_alone() -> None:
    cpu_model = _linear_model(6, 10, device="cpu")
    copy = meta_copy(cpu_model)
    assert all(p.device.type == "meta" for p in copy.parameters())
    assert all(p.device.type == "cpu" for p in cpu_model.parameters())
    assert copy.layer_names == cpu_model.layer_names and copy.task == "classify"


def test_defaults_come_from_the_zoo() -> None:
    spec = model_spec("gpt2-micro")
    profile = estimate("gpt2-micro", 2, gpu="H200", dtype="bfloat16", optimizer="adam")
    assert profile.seq_len == spec.default_seq_len and profile.image_size is None
    assert (profile.device, profile.dtype, profile.optimizer) == ("h200", "bfloat16", "adam")
    assert profile.optimizer_state_bytes == 2 * profile.param_bytes
    vit = estimate("vit-micro", 2)
    assert vit.image_size == model_spec("vit-micro").default_image_size and vit.seq_len is None


def test_errors_name_the_choices() -> None:
    with pytest.raises(PipeswapError, match="unknown model 'nope'.*gpt2-tiny"):
        estimate("nope", 2)
    with pytest.raises(PipeswapError, match="unknown GPU spec 'a99'.*v100-32gb"):
        estimate("gpt2-micro", 2, gpu="a99")
    with pytest.raises(PipeswapError, match="unknown dtype 'int8'.*bfloat16"):
        estimate("gpt2-micro", 2, dtype="int8")
    with pytest.raises(PipeswapError, match="unknown optimizer 'lamb'"):
        estimate("gpt2-micro", 2, optimizer="lamb")
    with pytest.raises(PipeswapError, match="batch must be at least 1"):
        estimate("gpt2-micro", 0)


@pytest.mark.slow
def test_gpt2_xl_estimate_is_fast_and_does_not_fit_a_v100() -> None:
    start = time.perf_counter()
    profile = estimate("gpt2-xl", 4, seq_len=1024, gpu="v100-32gb")
    assert time.perf_counter() - start < 60
    block = profile.layer("block0")
    tokens, hidden = 4 * 1024, 1600
    linear = 2 * tokens * hidden * (3 * hidden + hidden + 4 * hidden + 4 * hidden)
    attention = 4 * tokens * 1024 * hidden  # q k^T and p v, counted in full (not causal)
    assert block.forward_flops == linear + attention
    # Linear backward: 2x forward; attention backward: 2.5x (PyTorch's sdpa formula).
    assert block.backward_flops == 2 * linear + 5 * attention // 2
    assert profile.peak_training_bytes() > gpu_spec("v100-32gb").memory_bytes


def test_a_mixture_of_experts_estimate_matches_a_cpu_run(tmp_path: Path) -> None:
    # Its experts run torch's grouped_mm, whose meta kernel takes bfloat16 only; forward and
    # backward on meta take float32 as the CPU kernel does (pipeswap.models.meta_ops).
    path = save_model(tmp_path / "mixtral", "mixtral")
    estimated = estimate(path, 2, seq_len=16)
    measured = measure(path, 2, seq_len=16, warmup=0, repeats=1)
    assert [la.saved for la in estimated.layers] == [la.saved for la in measured.layers]
    assert estimated.memory == measured.memory  # every reading of the meter, byte for byte
