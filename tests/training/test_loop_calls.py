"""pipeswap/training/loop_calls.py: what a user's forward call looks like to offload."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.errors import PipeswapError
from pipeswap.training.loop_calls import (
    HeldOutputs,
    called_module,
    in_signed_modes,
    modes_of,
    offload_names,
    refuse_transforms,
    signature,
    takes_use_cache,
    without_cache,
)

CPU = torch.device("cpu")


def test_a_signature_is_the_shapes_the_other_values_and_the_autocast() -> None:
    x = torch.zeros(2, 3)
    same = signature((x,), {"flag": True}, CPU)
    assert signature((torch.ones(2, 3),), {"flag": True}, CPU) == same
    assert signature((torch.zeros(2, 4),), {"flag": True}, CPU) != same
    assert signature((x,), {"flag": False}, CPU) != same
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert signature((x,), {"flag": True}, CPU) != same
    # A model in eval mode saves less (no dropout masks): its calls are others.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1))
    training = signature((x,), {"flag": True}, CPU, modes_of(model))
    assert training != signature((x,), {"flag": True}, CPU, modes_of(model.eval()))
    assert training == signature((x,), {"flag": True}, CPU, modes_of(model.train()))


def test_a_mask_without_padding_is_another_call() -> None:
    """A Hugging Face model drops an attention mask of ones (it saves other tensors), so
    a batch without padding is not the padded batch's call; a vector of labels that
    happen to be equal is."""
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, 5:] = 0
    full = torch.ones(2, 8, dtype=torch.long)
    assert signature((), {"mask": padded}, CPU) != signature((), {"mask": full}, CPU)
    other = padded.clone()
    other[1, 6:] = 0
    assert signature((), {"mask": padded}, CPU) == signature((), {"mask": other}, CPU)
    labels = signature((), {"labels": torch.tensor([1, 2])}, CPU)
    assert labels == signature((), {"labels": torch.tensor([1, 1])}, CPU)


def test_the_cache_is_off_unless_asked_and_asking_for_it_is_refused() -> None:
    assert without_cache({"a": 1}) == {"a": 1, "use_cache": False}
    assert without_cache({"use_cache": False}) == {"use_cache": False}
    with pytest.raises(PipeswapError, match="pass use_cache=False"):
        without_cache({"use_cache": True})
    with pytest.raises(PipeswapError, match="leave past_key_values out"):
        without_cache({"past_key_values": object()})  # a cache object, any of its types
    assert without_cache({"past_key_values": None}) == {"past_key_values": None, "use_cache": False}
    # transformers 5 names the key-value cache `cache` (past_key_values is its deprecated
    # name); Mamba's, Reformer's and RWKV's caches have their own names.
    for name in ("cache", "cache_params", "past_buckets_states", "state"):
        with pytest.raises(PipeswapError, match=f"^{name} in a training forward.*leave {name} out"):
            without_cache({name: [torch.zeros(1)], "use_cache": False})


def test_a_transformers_cache_is_refused_under_any_name_or_position() -> None:
    transformers = pytest.importorskip("transformers")
    cache = transformers.DynamicCache()
    with pytest.raises(PipeswapError, match="leave my_cache out"):
        without_cache({"my_cache": cache})
    with pytest.raises(PipeswapError, match="leave a Cache object out"):
        without_cache({}, (torch.zeros(2, 3), cache))
    assert without_cache({"x": [cache]}, (torch.zeros(1),)) == {"x": [cache], "use_cache": False}

    def forward(input_ids: torch.Tensor, use_cache: bool | None = None) -> None: ...

    assert takes_use_cache(forward) and not takes_use_cache(torch.nn.Linear(2, 2).forward)
    assert not takes_use_cache(len)  # a builtin names no parameters


def test_a_forward_passing_kwargs_on_to_a_submodule_that_names_use_cache_takes_it() -> None:
    class Inner(torch.nn.Module):
        def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
            return x

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return self.inner(x, **kwargs)

    class Closed(Outer):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return self.inner(x)

    outer, closed = Outer(), Closed()
    assert takes_use_cache(outer.forward, outer) and not takes_use_cache(outer.forward)
    assert not takes_use_cache(closed.forward, closed)  # no **kwargs to pass it through
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert not takes_use_cache(plain.forward, plain)


def test_a_forward_inside_a_torch_func_transform_is_refused_saying_what_to_do() -> None:
    refuse_transforms()  # outside any transform: nothing to say

    def loss(x: torch.Tensor) -> torch.Tensor:
        refuse_transforms()
        return (x * x).sum()

    with pytest.raises(PipeswapError, match="inside a torch.func transform .* loss.backward"):
        torch.func.grad(loss)(torch.ones(3))


def test_a_step_aside_runs_in_the_modes_and_autocast_of_the_call_signed() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1))
    x = torch.zeros(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        signed = signature((x,), {}, CPU, modes_of(model))
    model.eval()
    model[0].weight.requires_grad_(False)  # a GAN's other step: frozen since
    with in_signed_modes(model, signed, CPU):
        assert modes_of(model) == ((True, True, True), (True, True))
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert modes_of(model) == ((False, False, False), (False, True))
    assert not torch.is_autocast_enabled("cpu")
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        in_signed_modes(model, signature((x,), {}, CPU, modes_of(model)), CPU),
    ):
        assert torch.is_autocast_enabled("cpu")  # signed under autocast: kept
    plain = signature((x,), {}, CPU)
    with torch.autocast("cpu", dtype=torch.bfloat16), in_signed_modes(model, plain, CPU):
        assert not torch.is_autocast_enabled("cpu")  # signed without it: off for the step


def test_held_outputs_are_a_forward_s_tensors_beyond_its_loss_alive_at_the_next() -> None:
    weight = torch.ones(3, 3, requires_grad=True)

    def forward() -> dict[str, torch.Tensor]:
        logits = torch.zeros(2, 3) @ weight
        return {"loss": logits.sum(), "logits": logits}

    watch = HeldOutputs()
    assert watch.held() is None  # nothing watched yet
    outputs = forward()
    watch.watch(outputs)
    assert watch.held() is True  # `outputs` still holds the logits
    assert watch.held() is None  # each watch is read once
    watch.watch(forward())
    assert watch.held() is False  # only the loss was kept
    watch.watch(torch.zeros(2, 3) @ weight)  # no loss: the step aside holds the output anyway
    assert watch.held() is None
    del outputs


def test_outputs_held_through_the_backward_of_a_step_function_are_seen() -> None:
    weight = torch.ones(3, 3, requires_grad=True)
    watch = HeldOutputs()

    def train_step(keep: bool) -> float:
        outputs = {"loss": None, "logits": torch.ones(2, 3) @ weight}
        outputs["loss"] = outputs["logits"].sum()  # saves none of the logits
        watch.watch(outputs)
        if keep:  # outputs.loss.backward(): the logits live through the backward
            outputs["loss"].backward()
            return float(outputs["loss"].detach())
        loss = outputs.pop("loss")
        del outputs  # only the loss reaches the backward
        loss.backward()
        return float(loss.detach())

    train_step(keep=True)  # its outputs are gone by the next forward
    assert watch.held() is True
    train_step(keep=False)
    assert watch.held() is False


def test_a_refusal_says_where_the_model_recomputes_its_layers_already() -> None:
    """A Hugging Face model with gradient checkpointing on is measured checkpointed: the
    smallest budget named is its checkpointed step's, which the refusal now says why."""

    class Checkpointed(nn.Linear):
        is_gradient_checkpointing = True

    refusal = "a budget of 5 bytes is too small; the smallest budget that works is 9 bytes"
    with pytest.raises(ConfigError, match="recomputes its layers already.*disable"):
        with offload_names(Checkpointed(2, 2)):
            raise ConfigError(refusal)
    with pytest.raises(ConfigError) as plain:
        with offload_names(nn.Linear(2, 2)):
            raise ConfigError(refusal)
    assert str(plain.value) == refusal


def test_a_container_no_loop_calls_is_refused_naming_what_to_pass() -> None:
    """offload(model.model.layers) hooked a ModuleList no loop calls: nothing was ever
    planned or swapped, silently. A module with a forward of its own is kept."""
    layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(ConfigError, match="ModuleList has no forward of its own.*offload"):
        called_module(layers)
    with pytest.raises(ConfigError, match="ModuleDict has no forward"):
        called_module(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    model = nn.Sequential(*layers)
    assert called_module(model) is model


def test_a_model_that_skips_layers_at_random_is_refused_naming_the_setting() -> None:
    """wav2vec2's default config drops layers (layerdrop=0.1): planning failed whenever a
    layer was skipped, with a message about the loss not reaching every layer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2, vocab_size=16,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"skips layers at random while training \(layerdrop"):
        called_module(transformers.Wav2Vec2ForCTC(config))
    config.layerdrop = 0.0
    model = transformers.Wav2Vec2ForCTC(config)
    assert called_module(model) is model
