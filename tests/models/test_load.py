"""pipeswap/models/load.py: Hugging Face directories and module:function names as LayeredModels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.data import MaskedLMDataset, dataset_for
from pipeswap.errors import PipeswapError
from pipeswap.models import build_model, model_spec, shape_defaults
from pipeswap.models.load import load_user_model
from tests.models.hf_configs import FAMILIES, save_config, save_model
from tests.models.tiny_lm import tiny_lm

pytest.importorskip("transformers")

_BLOCKS = {
    "gpt2": ["transformer.h.0", "transformer.h.1"],
    "llama": ["model.layers.0", "model.layers.1"],
    "bert": ["bert.encoder.layer.0", "bert.encoder.layer.1"],
    "vit": ["vit.layers.0", "vit.layers.1"],
    "resnet": ["resnet.encoder.stages.0", "resnet.encoder.stages.1"],
}


def _input(model, batch: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    if model.task == "lm":
        return torch.randint(0, 256, (batch, 16), generator=gen)
    return torch.randn(batch, 3, 32, 32, generator=gen)


def _root(model) -> nn.Module:
    return model.get_submodule("embed").replay.root


def _own_logits(model, x: torch.Tensor) -> torch.Tensor:
    key = "input_ids" if model.task == "lm" else "pixel_values"
    return _root(model)(**{key: x}).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_is_cut_at_its_layer_list_and_computes_what_the_model_does(
    tmp_path: Path, family: str
) -> None:
    model = load_user_model(save_config(tmp_path / family, family), seed=0)
    assert model.layer_names == ["embed", *_BLOCKS[family], "head"]
    x = _input(model)
    target = model.example_batch(2, seq_len=16, image_size=32, seed=1)[1]
    model.train()
    ours = model(x)
    model.loss(ours, target).backward()
    grads = {
        name: p.grad.clone() for name, p in _root(model).named_parameters() if p.grad is not None
    }
    model.zero_grad(set_to_none=True)
    theirs = _own_logits(model, x)
    model.loss(theirs, target).backward()
    assert torch.equal(ours, theirs)
    own = {name: p.grad for name, p in _root(model).named_parameters() if p.grad is not None}
    assert own.keys() == grads.keys() and len(own) > 0
    assert all(torch.equal(grads[name], own[name]) for name in own)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_belongs_to_one_layer_except_tied_ones(tmp_path: Path, family: str) -> None:
    model = load_user_model(save_config(tmp_path / family, family), seed=0)
    root_params = {id(p) for p in _root(model).parameters()}
    ours = {id(p) for p in model.parameters()}
    assert ours == root_params
    by_layer = [
        {id(p) for p in model.get_submodule(n).parameters()}
        if "." not in n
        else {id(p) for p in model._modules[n].parameters()}
        for n in model.layer_names
    ]
    shared = set.union(*[a & b for i, a in enumerate(by_layer) for b in by_layer[i + 1 :]])
    tied = family in ("gpt2", "bert")  # their configs tie the output layer to the embedding
    assert (len(shared) == 1) == tied


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_build_has_the_same_layers_and_shapes(tmp_path: Path, family: str) -> None:
    path = save_config(tmp_path / family, family)
    real, meta = load_user_model(path), load_user_model(path, device="meta")
    assert meta.layer_names == real.layer_names
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [
        (n, p.shape) for n, p in real.named_parameters()
    ]
    assert all(p.is_meta for p in meta.parameters())
    out = meta(_input(real).to("meta"))
    assert out.is_meta and out.shape == real(_input(real)).shape


def test_weights_load_and_without_them_the_init_is_seeded(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    with_weights = save_model(tmp_path / "weights", "gpt2")
    saved = transformers.GPT2LMHeadModel.from_pretrained(with_weights, local_files_only=True)
    loaded = load_user_model(with_weights)
    expected = dict(saved.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in _root(loaded).named_parameters())
    config_only = save_config(tmp_path / "config", "gpt2")
    a, b, c = (load_user_model(config_only, seed=s) for s in (0, 0, 1))
    flat = [torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c)]
    assert torch.equal(flat[0], flat[1]) and not torch.equal(flat[0], flat[2])
    state = torch.random.get_rng_state()
    load_user_model(config_only, seed=0)
    assert torch.equal(state, torch.random.get_rng_state())


def test_masked_lm_gets_a_mask_token_and_masked_batches(tmp_path: Path) -> None:
    model = load_user_model(save_config(tmp_path / "bert", "bert"))
    assert model.mask_token_id == 256  # the first id past the bytes (vocabulary 260)
    data = dataset_for(model, seq_len=16)
    assert isinstance(data, MaskedLMDataset)
    inputs, targets = data.batch(4, 0)
    masked = targets != -100
    assert masked.any() and torch.all(inputs[masked] == 256)
    assert torch.all(inputs[~masked] != 256)
    assert 0.05 < masked.float().mean() < 0.3


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("vit", {"num_labels": 1}, "num_labels=1"),
        ("gpt2", {"architectures": ["GPT2Model"]}, "has no head pipeswap trains"),
        ("gpt2", {"architectures": ["NoSuchModel"]}, "has no class 'NoSuchModel'"),
    ],
)
def test_configs_pipeswap_cannot_train_are_refused(
    tmp_path: Path, family: str, overrides: dict, message: str
) -> None:
    path = save_config(tmp_path / family, family, **overrides)
    with pytest.raises(PipeswapError, match=message):
        load_user_model(path)


def test_directories_that_are_not_models_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipeswapError, match="no config.json"):
        load_user_model(str(tmp_path / "empty"))
    (tmp_path / "noarch").mkdir()
    (tmp_path / "noarch" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(PipeswapError, match="names no architecture"):
        load_user_model(str(tmp_path / "noarch"))


def test_special_files_and_label_floods_in_a_model_directory_are_refused(tmp_path: Path) -> None:
    # A FIFO would block transformers' open(), /dev/zero would be read without end, and
    # 10**8 labels exhausted the memory while transformers expanded them.
    for name, make in (
        ("config.json", lambda p: os.mkfifo(p)),
        ("tokenizer.json", lambda p: p.symlink_to("/dev/zero")),
    ):
        path = Path(save_config(tmp_path / name, "gpt2"))
        (path / name).unlink(missing_ok=True)
        make(path / name)
        with pytest.raises(PipeswapError, match=rf"{name} is no regular file"):
            load_user_model(str(path), device="meta")
    path = Path(save_config(tmp_path / "labels", "vit"))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_labels": 10**8, "id2label": {}}))
    with pytest.raises(PipeswapError, match="has 100,000,000 labels; .* at most 1,000,000"):
        load_user_model(str(path), device="meta")


def test_vit_takes_only_its_image_size(tmp_path: Path) -> None:
    path = save_config(tmp_path / "vit", "vit")
    assert model_spec(path).default_image_size == 32
    with pytest.raises(ConfigError, match="pass image_size 32") as info:
        build_model(path, image_size=64)
    assert "pass {image_size} 32" in info.value.message  # the CLI says --image-size 32


# ---- module:function ----------------------------------------------------------------------


def test_module_function_names_load_through_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tiny_lm_module", sys.modules[__name__])
    monkeypatch.setattr(sys.modules[__name__], "build", tiny_lm, raising=False)
    model = build_model("tiny_lm_module:build", seed=3)
    assert model.layer_names[1:4] == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(PipeswapError, match="no default sequence length"):
        shape_defaults("tiny_lm_module:build", None, None)


@pytest.mark.parametrize(
    "overrides",
    [
        {"n_head": 5},  # heads that do not divide the width (64)
        {"n_embd": "wide"},  # a string where a number goes
        {"vocab_size": -5},  # a negative size
        {"model_type": None},  # no model_type: transformers cannot tell the family
    ],
)
def test_configs_transformers_cannot_build_are_one_clear_error(
    tmp_path: Path, overrides: dict
) -> None:
    path = save_config(tmp_path / "bad", "gpt2")
    raw = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**raw, **overrides}))
    with pytest.raises(
        PipeswapError, match=r"config.json: transformers cannot build GPT2LMHeadModel"
    ):
        load_user_model(path)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "other config", "no shard"])
def test_damaged_or_mismatched_weights_are_one_clear_error(tmp_path: Path, damage: str) -> None:
    path = Path(save_model(tmp_path / "model", "gpt2"))
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "garbage":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "no shard":  # an index naming a shard that is not there
        weights.unlink()
        index = {
            "metadata": {},
            "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"},
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_model(tmp_path / "wider", "gpt2", n_embd=128)
        weights.write_bytes((tmp_path / "wider" / "model.safetensors").read_bytes())
    with pytest.raises(PipeswapError, match=f"cannot load the weights in {path}"):
        load_user_model(str(path))


def test_loading_weights_on_a_rank_prints_nothing(tmp_path: Path) -> None:
    # Before: every rank printed transformers' "Loading weights" bar, and a semaphore of
    # tqdm's leaked at the rank's os._exit (the resource tracker warned).
    path = save_model(tmp_path / "model", "gpt2")
    code = (
        "import os, sys\n"
        "from pipeswap.models.load import load_user_model\n"
        f"load_user_model({path!r})\n"
        "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n"
    )
    env = {**os.environ, "RANK": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_a_file_named_as_a_model_says_what_a_model_path_holds(tmp_path: Path) -> None:
    script = tmp_path / "my_models.py"
    script.write_text("import torch\n")
    for path in (script, tmp_path / "weights.safetensors"):
        path.touch()
        with pytest.raises(PipeswapError, match=f"{path} is a file; a model is a zoo name") as info:
            build_model(str(path))
        assert f"write {path.stem}:FUNCTION" in str(info.value)


@pytest.mark.parametrize(
    "source, message",
    [
        (
            'raise RuntimeError("at import")\n',
            r"importing {mod} for {mod}:build failed \(RuntimeError: at import\)",
        ),
        ("def build(:\n", r"importing {mod} for {mod}:build failed \(SyntaxError: "),
        (
            "import torch\ndef build():\n    with torch.device('meta'):\n"
            "        return torch.nn.Sequential(torch.nn.Embedding(300, 8), torch.nn.Linear(8, 300))\n",
            r"{mod}:build returned a model on the meta device",
        ),
    ],
)
def test_user_modules_that_cannot_give_a_model_are_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, message: str
) -> None:
    mod = f"user_models_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PipeswapError, match=message.format(mod=mod)):
        load_user_model(f"{mod}:build")


def test_a_small_vocabulary_loads_and_only_the_byte_level_data_refuses_it(tmp_path: Path) -> None:
    model = load_user_model(save_config(tmp_path / "gpt2", "gpt2", vocab_size=100))
    assert model.vocab_size == 100  # trains on the user's own tokens
    with pytest.raises(PipeswapError, match="vocabulary of 100 tokens.*your own data"):
        dataset_for(model, seq_len=16)


def test_a_module_in_the_working_directory_loads_as_python_m_finds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A console script's sys.path lacks the working directory: `pipeswap train --model
    my_models:build` with my_models.py there finds it all the same."""
    (tmp_path / "my_cwd_models.py").write_text(
        "from tests.models.tiny_lm import tiny_lm\n\ndef build():\n    return tiny_lm()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_models", raising=False)
    assert load_user_model("my_cwd_models:build").layer_names[1] == "blocks.0"
    with pytest.raises(PipeswapError, match="in the working directory or on PYTHONPATH"):
        load_user_model("not_a_module_anywhere:build")
