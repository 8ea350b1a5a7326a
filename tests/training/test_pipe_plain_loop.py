"""pipeswap.Pipeline trains what the user's own plain loop trains, on what users bring:
labels padded with -100 (a padding collator), frozen parameters, optimizer functions that
group parameters by identity, parameters the model's root holds itself."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswap.config_fields import ConfigError
from pipeswap.dist.launch import spawn
from pipeswap.errors import PipeswapError
from pipeswap.training.pipe import Pipeline
from tests.models.tiny_lm import TinyLM

Factory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_configs import hf_config

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_config("llama"))


def _padded(steps: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels as a collator pads them: rows of 1 to 12 tokens, -100 after;
    rows 0-1 of the first batch are padding only (a micro-batch that scores nothing)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 200, (steps, 8, 12), generator=g)
    labels = ids.clone()
    lengths = torch.randint(1, 13, (steps, 8), generator=g)
    labels[torch.arange(12) >= lengths[..., None]] = -100
    labels[0, :2] = -100
    return ids, labels


def _plain(
    model: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    factory: Factory,
    loss_of: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[float]:
    optimizer = factory(list(model.parameters()))
    losses = []
    for x, y in batches:
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _same_weights(state: dict[str, torch.Tensor] | None, plain: nn.Module) -> None:
    assert state is not None
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-5, atol=2e-6, msg=name)


def _own_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=y).loss


def test_padded_labels_weigh_each_micro_batch_by_the_tokens_it_scores() -> None:
    """The model's own loss over the whole batch is a mean over its scored tokens: the
    pipeline weighs its micro-batches' losses by their share of them (a micro-batch of
    padding only adds nothing, where its own mean would be NaN)."""
    ids, labels = _padded()
    model = _llama()
    plain = copy.deepcopy(model)
    factory: Factory = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    pipe = Pipeline(model, stages=1, steps=2, micro_batches=4, optimizer=factory)
    losses = [pipe.step(x, labels=y) for x, y in zip(ids, labels)]
    expected = _plain(plain, list(zip(ids, labels)), factory, _own_loss)
    assert losses == pytest.approx(expected, rel=1e-6)
    _same_weights(pipe.state_dict(), plain)
    held_out = pipe.eval(ids[0], labels=labels[0])
    with torch.no_grad():
        assert held_out == pytest.approx(
            _own_loss(plain.eval(), ids[0], labels[0]).item(), rel=1e-6
        )


def test_targets_padded_with_ignore_index_score_as_one_cross_entropy() -> None:
    ids, labels = _padded()
    torch.manual_seed(0)
    model = TinyLM()
    plain = copy.deepcopy(model)
    factory: Factory = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    pipe = Pipeline(model, stages=1, steps=2, micro_batches=4, optimizer=factory)
    losses = [pipe.step(x, target=y) for x, y in zip(ids, labels)]

    def whole(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(net(x).reshape(-1, 256), y.reshape(-1), ignore_index=-100)

    assert losses == pytest.approx(_plain(plain, list(zip(ids, labels)), factory, whole), rel=1e-6)
    _same_weights(pipe.state_dict(), plain)


def test_a_loss_function_of_the_user_s_with_uneven_padding_is_warned_about() -> None:
    ids, labels = _padded(1)
    pipe = Pipeline(
        TinyLM(),
        stages=1,
        steps=1,
        micro_batches=4,
        loss_fn=lambda out, y: F.cross_entropy(out.reshape(-1, 256), y.reshape(-1)),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
    )
    labels[0, :2] = 7  # every micro-batch scores some tokens: its own mean is finite
    with pytest.warns(UserWarning, match="cannot tell how the loss counts"):
        pipe.step(ids[0], target=labels[0])


def test_frozen_parameters_stay_and_optimizer_groups_chosen_by_identity_hold() -> None:
    """A frozen embedding is not moved by AdamW's weight decay (it has no gradient), and
    the optimizer function sees the model's own parameters: groups chosen by identity (no
    decay on norms) are the groups the plain loop has."""
    model = _llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    plain = copy.deepcopy(model)
    frozen = model.model.embed_tokens.weight.detach().clone()

    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        norms = {id(p) for n, p in model.named_parameters() if "norm" in n}
        norms |= {id(p) for n, p in plain.named_parameters() if "norm" in n}
        return torch.optim.AdamW(
            [
                {"params": [p for p in params if id(p) not in norms], "weight_decay": 0.5},
                {"params": [p for p in params if id(p) in norms], "weight_decay": 0.0},
            ],
            lr=1e-2,
        )

    ids = torch.randint(5, 200, (2, 4, 12), generator=torch.Generator().manual_seed(1))
    pipe = Pipeline(model, stages=1, steps=2, micro_batches=1, optimizer=factory)
    losses = [pipe.step(x, labels=x) for x in ids]
    expected = _plain(plain, [(x, x) for x in ids], factory, _own_loss)
    assert losses == pytest.approx(expected, rel=1e-6)
    state = pipe.state_dict()
    _same_weights(state, plain)
    assert state is not None and torch.equal(state["model.embed_tokens.weight"], frozen)


def test_an_optimizer_over_other_parameters_is_refused() -> None:
    other = nn.Linear(2, 2)
    pipe = Pipeline(
        TinyLM(),
        stages=1,
        steps=1,
        micro_batches=1,
        optimizer=lambda ps: torch.optim.SGD([*ps, *other.parameters()], lr=0.1),
    )
    with pytest.raises(ConfigError, match="parameter\\(s\\) it was not given"):
        pipe.step(torch.zeros(2, 4, dtype=torch.long), target=torch.zeros(2, 4, dtype=torch.long))


class _PositionTable(nn.Module):
    """A language model whose learned position table is the root's own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.pos = nn.Parameter(torch.randn(12, 16) * 0.1)
        self.blocks = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)]
        )
        self.temperature = nn.Parameter(torch.ones(()))
        self.out = nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(ids) + self.pos[: ids.shape[1]])
        # The embedding's weight read again after the blocks: an output tied by hand.
        return (self.out(h) + h @ self.embed.weight.T) / self.temperature


_ROOT_BATCHES = torch.randint(0, 64, (3, 4, 12), generator=torch.Generator().manual_seed(2))


def _root_model() -> nn.Module:
    torch.manual_seed(0)
    return _PositionTable()


def _root_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x).reshape(-1, 64), y.reshape(-1))


_RATES = (1.0, 0.1, 0.01)  # a user's scheduler, stepped after each step


def _scheduled(schedulers: list[Any]) -> Factory:
    def factory(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.3)
        schedulers.append(
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: _RATES[min(t, len(_RATES) - 1)])
        )
        return optimizer

    return factory


def _train_root(rank: int, world: int) -> dict[str, Any]:
    schedulers: list[Any] = []
    pipe = Pipeline(
        _root_model(), stages=world, steps=3, schedule="1f1b", micro_batches=2,
        optimizer=_scheduled(schedulers),
    )  # fmt: skip
    losses, held_out, mid_run = [], None, None
    for t, x in enumerate(_ROOT_BATCHES):
        losses.append(pipe.step(x, target=x.roll(-1, 1)))
        for scheduler in schedulers:
            scheduler.step()
        if t == 0:  # between steps: the weights after the first, the tied one's too
            held_out = pipe.eval(x, target=x.roll(-1, 1))
            taken = pipe.state_dict()  # the model's own tensors, as model.state_dict()'s
            mid_run = None if taken is None else {k: v.clone() for k, v in taken.items()}
    state = pipe.state_dict()
    pipe.close()
    return {"losses": losses, "state": state, "held_out": held_out, "mid_run": mid_run}


@pytest.mark.dist
def test_parameters_the_root_holds_train_on_the_stages_that_use_them() -> None:
    """The position table is read before the blocks (stage 0), the temperature after them
    (stage 1), and the embedding's weight on both sides (tied across the stages): each
    trains as in the plain loop, at the rate the user's scheduler sets for each step, and
    between steps a held-out batch and the weights taken see every update made."""
    plain = _root_model()
    schedulers: list[Any] = []
    optimizer = _scheduled(schedulers)(list(plain.parameters()))
    expected, held_out, mid_run = [], 0.0, {}
    for t, x in enumerate(_ROOT_BATCHES):
        loss = _root_loss(plain, x, x.roll(-1, 1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        schedulers[0].step()
        expected.append(loss.item())
        if t == 0:
            with torch.no_grad():
                held_out = _root_loss(plain, x, x.roll(-1, 1)).item()
            mid_run = copy.deepcopy(plain)
    launched = spawn(_train_root, 2, timeout_s=120)
    assert launched.ok, launched.exit_codes
    first, last = launched.results
    assert last["losses"] == pytest.approx(expected, rel=1e-5)
    assert last["held_out"] == pytest.approx(held_out, rel=1e-6)
    _same_weights(first["mid_run"], mid_run)
    _same_weights(first["state"], plain)
    assert not torch.equal(first["state"]["pos"], _root_model().pos.detach())


_TWO_PIPELINES = """
import sys
import torch
import pipeswap
sys.path.insert(0, sys.argv[2])
from tests.models.tiny_lm import TinyLM

batches = torch.randint(0, 256, (4, 4, 8), generator=torch.Generator().manual_seed(0))
states = []
for mid_run in (False, True):  # one script, two pipelines: the second takes weights each step
    torch.manual_seed(0)
    pipe = pipeswap.Pipeline(
        TinyLM(), stages=2, steps=4, schedule="async-1f1b",
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    )
    for x in batches:
        pipe.step(x, target=x.roll(-1, 1))
        if mid_run:
            pipe.state_dict()
    states.append(pipe.state_dict())
    pipe.close()
if states[0] is not None:
    torch.save(states, sys.argv[1])
"""


@pytest.mark.dist
def test_a_second_pipeline_in_one_script_and_weights_taken_mid_run(tmp_path: Path) -> None:
    """Under torchrun a script may build a pipeline after closing one (its process group
    is joined afresh), and take the weights after every step of an asynchronous schedule
    without changing what it trains (the graphs in flight keep their weights)."""
    script = tmp_path / "two_pipelines.py"
    script.write_text(_TWO_PIPELINES)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), str(tmp_path / "states.pt"), str(root)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plain, taken = torch.load(tmp_path / "states.pt")
    assert plain.keys() == taken.keys()
    assert all(torch.equal(plain[name], taken[name]) for name in plain)


def test_misuse_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    ids = torch.randint(0, 256, (4, 8))
    pipe = Pipeline(TinyLM(), stages=1, steps=2, micro_batches=2)
    with pytest.raises(ConfigError, match="no batch: pass \\[batch, seq_len\\]"):
        pipe.step(ids[0], target=ids[0])
    pipe.step(ids, target=ids)
    pipe.save(tmp_path)
    changed = TinyLM()
    changed.out = nn.Linear(16, 256, bias=False)  # another head than the saved model's
    other = Pipeline(changed, stages=1, steps=2, micro_batches=2)
    other.load(tmp_path)
    with pytest.raises(PipeswapError, match="checkpoint holds other weights"):
        other.step(ids, target=ids)
    pipe.close()  # its process groups are gone: nothing may follow, each call says so
    for call in (pipe.state_dict, lambda: pipe.eval(ids, target=ids)):
        with pytest.raises(ConfigError, match="after pipe.close\\(\\), which freed"):
            call()
