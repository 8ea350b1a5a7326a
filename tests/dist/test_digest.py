"""params_sha256: name-sorted, and the same for a whole model as for its stages combined.

Covers: pipeswap/dist/digest.py.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from pipeswap.dist.digest import combine_digests, parameter_digests, params_sha256, tensor_sha256
from pipeswap.models import build_model


def test_the_digest_is_the_documented_formula() -> None:
    model = nn.Linear(3, 2)
    expected = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        one = hashlib.sha256(f"{name}:{param.dtype}:{tuple(param.shape)};".encode())
        one.update(param.detach().numpy().tobytes())
        expected.update(f"{name}:{one.hexdigest()};".encode())
    assert params_sha256(model) == expected.hexdigest()


def test_stages_combine_to_the_whole_model_digest() -> None:
    model = build_model("gpt2-micro", tie_embeddings=False)  # each stage owns its weights
    names = model.layer_names
    stages = [model.stage(0, 2), model.stage(2, len(names))]
    digests: dict[str, str] = {}
    for stage in reversed(stages):  # any order: combining sorts by name
        digests.update(parameter_digests(stage))
    assert combine_digests(digests) == params_sha256(model)


def test_any_change_of_value_name_or_dtype_changes_the_digest() -> None:
    a = torch.zeros(4)
    assert tensor_sha256("w", a) != tensor_sha256("v", a)
    assert tensor_sha256("w", a) != tensor_sha256("w", a.double())
    b = a.clone()
    b[3] = 1e-30
    assert tensor_sha256("w", a) != tensor_sha256("w", b)
    assert tensor_sha256("w", torch.zeros(0)) == tensor_sha256("w", torch.zeros(0))
