"""pipeswap/profiling/meta_attention.py: meta runs read attention's costs as the CPU runs it."""

import torch
import torch.nn.functional as F

from pipeswap.models import build_model
from pipeswap.profiling.meta_attention import meta_attention_like_cpu
from pipeswap.profiling.saved import capture_saved


def test_attention_on_meta_saves_linear_not_quadratic_memory() -> None:
    model = build_model("gpt2-micro", device="meta")
    tokens, _ = model.example_batch(2, seq_len=64, device="meta")
    records = capture_saved(model, tokens)
    heads, seq = 2, 64
    shapes = [r.shape for r in records["block0"]]
    assert (2, heads, seq) in shapes  # the flash kernel's logsumexp
    assert all(shape[-2:] != (seq, seq) for shape in shapes)  # no T x T attention matrix


def test_a_boolean_mask_on_meta_gives_the_shape_the_cpu_gives_and_cpu_runs_are_unchanged() -> None:
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with meta_attention_like_cpu():
        inside = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        meta = F.scaled_dot_product_attention(
            *(t.to("meta") for t in (q, k, v)), attn_mask=mask.to("meta")
        )
    assert torch.equal(inside, plain)
    assert meta.device.type == "meta" and meta.shape == plain.shape
