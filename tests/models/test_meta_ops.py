"""pipeswap/models/meta_ops.py: meta runs that take what the real kernels take."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeswap.models import model_spec
from pipeswap.models.load import load_hf_model, load_user_model
from pipeswap.models.meta_ops import meta_like_real
from tests.models.hf_configs import save_model

_OFFS = torch.tensor([3, 5, 8], dtype=torch.int32)  # 3 groups over 8 rows (or columns)
# (mat_a, mat_b, offs): every layout grouped_mm takes, as transformers' experts and their
# backward call it (the weight transposed too, with an output row padded to 16 bytes).
_CASES = {
    "2d-3d": lambda: (torch.randn(8, 16), torch.randn(3, 16, 24), _OFFS),
    "2d-3d-transposed": lambda: (torch.randn(8, 16), torch.randn(3, 24, 16).mT, _OFFS),
    "2d-3d-padded-row": lambda: (torch.randn(8, 16), torch.randn(3, 10, 16).mT, _OFFS),
    "2d-2d": lambda: (torch.randn(16, 8), torch.randn(8, 24), _OFFS),
    "3d-2d": lambda: (torch.randn(3, 16, 8), torch.randn(8, 24), _OFFS),
    "3d-3d": lambda: (torch.randn(3, 8, 16), torch.randn(3, 16, 24), None),
}


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return tuple(t.shape), t.stride(), t.dtype


def _meta(t: torch.Tensor | None, grad: bool = False) -> torch.Tensor | None:
    return None if t is None else t.detach().to("meta").requires_grad_(grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", list(_CASES))
def test_grouped_mm_on_meta_is_what_the_real_kernel_computes(case: str, dtype: torch.dtype) -> None:
    a, b, offs = _CASES[case]()
    a, b = a.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
    real = F.grouped_mm(a, b, offs=offs)
    meta_a, meta_b = _meta(a, grad=True), _meta(b, grad=True)
    with pytest.raises(RuntimeError, match="BF16"):  # what torch's own meta kernel says
        F.grouped_mm(meta_a, meta_b, offs=_meta(offs))
    with meta_like_real():
        meta = F.grouped_mm(meta_a, meta_b, offs=_meta(offs))
        assert _layout(meta) == _layout(real)
        if case == "2d-3d-padded-row":
            return  # the real backward refuses a gradient whose rows are 40 bytes apart
        meta.backward(torch.empty(meta.shape, dtype=dtype, device="meta"))
    real.backward(torch.randn(real.shape, dtype=dtype))
    assert meta_a is not None and meta_b is not None
    assert meta_a.grad is not None and meta_b.grad is not None
    assert a.grad is not None and b.grad is not None
    assert _layout(meta_a.grad) == _layout(a.grad)
    assert _layout(meta_b.grad) == _layout(b.grad)


def test_what_the_real_kernel_refuses_stays_refused_and_real_tensors_run_as_ever() -> None:
    a, b = torch.randn(8, 16), torch.randn(3, 16, 24)
    with meta_like_real():
        for bad_a, bad_b in ((a.double(), b.double()), (a, b[:, :15]), (a, b.half())):
            with pytest.raises(RuntimeError):
                F.grouped_mm(_meta(bad_a), _meta(bad_b), offs=_meta(_OFFS))
        inside = F.grouped_mm(a, b, offs=_OFFS)
    assert torch.equal(inside, F.grouped_mm(a, b, offs=_OFFS))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_directory_is_read_on_meta_and_trains_as_it_loads(
    tmp_path: Path, family: str
) -> None:
    path = save_model(tmp_path / family, family)
    # The directory's own model: from_pretrained picks torch's grouped_mm for its experts,
    # whose meta kernel refuses float32 (the spec read on meta failed so).
    own = load_hf_model(path)
    assert own.config._experts_implementation == "grouped_mm"
    spec = model_spec(path)
    assert (spec.task, spec.vocab_size, spec.max_seq_len) == ("lm", 256, 64)
    meta = load_user_model(path, device="meta")
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with meta_like_real():
        out = meta(x.to("meta"))
    # What trains is the directory's model, with its own experts implementation.
    real = load_user_model(path)
    root = real.get_submodule("embed").replay.root
    assert root.config._experts_implementation == "grouped_mm"
    logits = real(x)
    assert out.is_meta and out.shape == logits.shape
    torch.testing.assert_close(logits, own(input_ids=x).logits)
