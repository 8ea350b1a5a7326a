"""Replay splitting: a module's own forward, with its blocks stubbed, as LayeredModel layers.

A user's model (a Hugging Face model, or any ``nn.Module``) is cut at *block boundaries*
without re-implementing its forward. The blocks are the model's repeated layer list or
dotted module paths the user names (pipeswap.models.blocks). The LayeredModel then has:

- ``embed``: runs the model's own forward up to the first block (embeddings, position
  ids, rotary tables, attention masks: whatever its code computes there) and hands on the
  first block's input, the tensors the blocks take besides it (the *context*) and the
  model's input;
- one layer per block, named by its module path (``transformer.h.0``), calling the block
  with its hidden state and the context, exactly as the model's forward called it;
- ``head``: runs the model's own forward again with every block replaced by a
  pass-through that returns the last block's output (the code before the blocks leaves no
  trace of running twice: pipeswap.models.replay_rerun), so the code after the blocks is
  the model's own.

The forward runs unchanged, its blocks stubbed. Checked when the layers are built: the
blocks feed each other directly, and what they receive besides the hidden state does not
depend on earlier blocks (Hugging Face's GPT-2, Llama, BERT, ViT and ResNet do both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from pipeswap.errors import PipeswapError
from pipeswap.models.base import LayeredModel
from pipeswap.models.blocks import check_block_paths, find_blocks, modules_around, removed_after
from pipeswap.models.replay_check import (
    check_reproduces,
    context_of,
    expected_calls,
    hidden_of,
    same_tensor,
)
from pipeswap.models.replay_rerun import rerun_quietly
from pipeswap.models.root_state import RootTensorHolder, adopt_root_tensors, follow_root_mode
from pipeswap.models.state import inspecting

__all__ = ["Replay", "split_at_blocks"]

# Non-tensor values a block may receive; anything else (a cache object) would be shared
# between calls, so it is refused.
_CONSTANT_TYPES = (type(None), bool, int, float, str)


class _Stop(Exception):
    """Raised by a hook to end the model's forward once the wanted values are captured."""


@dataclass(frozen=True)
class _Source:
    """Where a block's argument leaf comes from: the hidden state, a context tensor, a constant."""

    kind: str  # "hidden" | "context" | "constant"
    value: Any = None  # context index, or the constant


@dataclass
class _BlockCall:
    """How the model calls one block: its arguments as a tree whose leaves are sources
    (the hidden state, a context tensor, a constant)."""

    spec: pytree.TreeSpec
    sources: list[_Source]
    output_arity: int  # 0: the block returns a tensor; n: a tuple (or list) of n, hidden first
    output_list: bool = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _BlockCall:
        return self  # immutable in use: a meta copy of the model shares it


class Replay:
    """The wrapped model and the facts the embed/block/head layers share about it."""

    def __init__(
        self,
        root: nn.Module,
        paths: Sequence[str],
        input_name: str | None,
        output_fn: Callable[[Any], torch.Tensor],
        call_kwargs: dict[str, Any],
    ) -> None:
        self.root = root
        self.paths = list(paths)
        self.blocks = [root.get_submodule(p) for p in self.paths]
        self.input_name = input_name
        self.output_fn = output_fn
        self.call_kwargs = call_kwargs
        self.calls: list[_BlockCall] = []
        self.embed_owned: list[nn.Module] = []  # the embed layer's modules (split_at_blocks)
        # Labels the model's own forward gets (:meth:`labelled`), and what it returned then.
        self.labels: torch.Tensor | None = None
        self.own_output: Any = None
        self.num_context = 0
        # Entered around every run of the model's forward (Hugging Face: meta-safe masks).
        self.run_context: Callable[[torch.Tensor], AbstractContextManager[Any]] = lambda _inputs: (
            nullcontext()
        )

    def run_root(self, inputs: torch.Tensor) -> Any:
        labels = {} if self.labels is None else {"labels": self.labels}
        with self.run_context(inputs):
            if self.input_name is None:
                return self.root(inputs, **self.call_kwargs)
            return self.root(**{self.input_name: inputs}, **self.call_kwargs, **labels)

    @contextmanager
    def labelled(self, labels: torch.Tensor) -> Iterator[None]:
        """The model's forward gets ``labels`` meanwhile: the head computes its own loss
        (:meth:`own_loss`), as ``model(input_ids=x, labels=labels).loss`` would."""
        self.labels = labels
        try:
            yield
        finally:
            self.labels = None

    def own_loss(self) -> torch.Tensor:
        loss = getattr(self.own_output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise PipeswapError(
                f"{type(self.root).__name__} computed no loss from the labels; pass target= "
                "(cross-entropy of its logits) instead"
            )
        return loss

    @contextmanager
    def stubbed(self, returns: Callable[[int, Any], Any]) -> Iterator[None]:
        """Replace every block's forward by ``returns(index, hidden)`` for the duration."""
        for index, block in enumerate(self.blocks):

            def stub(*args: Any, _index: int = index, **kwargs: Any) -> Any:
                return returns(_index, hidden_of(args, kwargs))

            block.forward = stub
        try:
            yield
        finally:
            for block in self.blocks:
                del block.forward

    def shaped_like_output(self, index: int, hidden: Any) -> Any:
        """What a stub of block ``index`` returns: the hidden state where the block returns
        it, None in place of its other outputs (attention weights, caches: the forward
        reads them only when asked to return them, which pipeswap never asks)."""
        call = self.calls[index]
        if call.output_arity == 0:
            return hidden
        shaped = (hidden, *([None] * (call.output_arity - 1)))
        return list(shaped) if call.output_list else shaped

    def capture(self, inputs: torch.Tensor) -> tuple[Any, list[tuple[Any, ...]]]:
        """Run the model up to its last block with the blocks stubbed; return the first
        block's hidden input and every block's (args, kwargs)."""
        received: list[tuple[Any, ...]] = []
        last = self.blocks[-1]

        def record(module: nn.Module, args: Any, kwargs: Any) -> None:
            received.append((args, kwargs))
            if module is last:
                raise _Stop

        hooks = [b.register_forward_pre_hook(record, with_kwargs=True) for b in self.blocks]
        try:
            with removed_after(hooks), self.stubbed(self.shaped_like_output):
                self.run_root(inputs)
        except _Stop:
            pass
        if len(received) != len(self.blocks):
            raise PipeswapError(
                f"the model's forward called {len(received)} of its {len(self.blocks)} blocks "
                f"({', '.join(self.paths[:3])}...); name blocks its forward calls every time"
            )
        return hidden_of(*received[0]), received


class _AroundBlocks(RootTensorHolder):
    """The embed or head layer: it runs the model's own code outside the blocks (and holds
    the root's own tensors it reads: pipeswap.models.root_state)."""

    def __init__(self, replay: Replay, owned: dict[str, nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "replay", replay)  # not a child: it holds every block
        for path, module in owned.items():
            self._modules[path] = module

    def train(self, mode: bool = True) -> _AroundBlocks:
        """Also the mode of the model's modules outside its blocks (the root, a dropout)."""
        super().train(mode)
        replay: Replay = self.replay  # type: ignore[assignment]
        inside = {id(m) for block in replay.blocks for m in block.modules()}
        for module in replay.root.modules():
            if id(module) not in inside:
                module.training = mode
        return self


class _Embed(_AroundBlocks):
    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        replay: Replay = self.replay  # type: ignore[assignment]
        hidden, received = replay.capture(inputs)
        context = list(context_of(hidden, received).values())
        if len(context) != replay.num_context:
            raise PipeswapError(
                f"the model passed its blocks {len(context)} tensors besides the hidden state, "
                f"but {replay.num_context} when pipeswap inspected it; its forward must call "
                "the blocks the same way every time"
            )
        return (hidden, *context, inputs)


class _Block(nn.Module):
    def __init__(self, replay: Replay, index: int, block: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "replay", replay)
        self.index = index
        self._modules["block"] = block

    def forward(self, packed: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        replay: Replay = self.replay  # type: ignore[assignment]
        call = replay.calls[self.index]
        hidden, context = packed[0], packed[1 : 1 + replay.num_context]
        leaves = [
            hidden if s.kind == "hidden" else context[s.value] if s.kind == "context" else s.value
            for s in call.sources
        ]
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        output = self.get_submodule("block")(*args, **kwargs)
        new_hidden = output if call.output_arity == 0 else output[0]
        return (new_hidden, *packed[1:])


class _Head(_AroundBlocks):
    def forward(self, packed: tuple[torch.Tensor, ...]) -> torch.Tensor:
        replay: Replay = self.replay  # type: ignore[assignment]
        hidden, inputs = packed[0], packed[-1]
        last = len(replay.blocks) - 1

        # The re-run passes the embed layer's modules again, as they ran there, and leaves
        # no trace of it (pipeswap.models.replay_rerun).
        mine = set(self.modules())
        again = [m for o in replay.embed_owned for m in o.modules() if m not in mine]
        with rerun_quietly([replay.root, *again], inputs.device) as at_first_block:

            def returns(index: int, passed: Any) -> Any:
                if index == 0:
                    at_first_block()
                return replay.shaped_like_output(index, hidden if index == last else passed)

            with replay.stubbed(returns):
                replay.own_output = replay.run_root(inputs)
                return replay.output_fn(replay.own_output)


def split_at_blocks(
    model: nn.Module,
    *,
    example: torch.Tensor,
    task: str,
    name: str,
    blocks: Sequence[str] | None = None,
    input_name: str | None = None,
    output_fn: Callable[[Any], torch.Tensor] = lambda out: out,
    call_kwargs: dict[str, Any] | None = None,
    run_context: Callable[[torch.Tensor], AbstractContextManager[Any]] | None = None,
    vocab_size: int = 0,
    num_classes: int = 0,
    in_channels: int = 3,
) -> LayeredModel:
    """``model`` as a LayeredModel cut at ``blocks`` (default: ``find_blocks(model)``).

    ``example`` is a small input the model takes (token ids or images): the adapter runs
    the model on it once, in eval mode, without gradients and with the RNG forked, to learn
    how the forward calls the blocks, and checks that replay splitting reproduces the model
    (see the module docstring). ``input_name`` passes the input as that keyword argument
    (``input_ids``); ``output_fn`` maps the model's output to the logits.
    """
    if isinstance(model, LayeredModel):
        return model
    extra = {} if call_kwargs is None else dict(call_kwargs)
    if isinstance(model, nn.Sequential) and blocks is None:
        children = list(model.named_children())
        return LayeredModel(
            name,
            children,
            task,
            vocab_size=vocab_size,
            num_classes=num_classes,
            in_channels=in_channels,
        )
    paths = list(blocks) if blocks is not None else find_blocks(model)
    check_block_paths(model, paths)
    replay = Replay(model, paths, input_name, output_fn, extra)
    if run_context is not None:
        replay.run_context = run_context
    with inspecting(model):
        embed_owned, head_owned = modules_around(
            model, replay.blocks, lambda: replay.run_root(example)
        )
        expected = expected_calls(replay, example)
        _learn_calls(replay, example, expected)
        replay.embed_owned = list(embed_owned.values())
        layers: list[tuple[str, nn.Module]] = [("embed", _Embed(replay, embed_owned))]
        layers += [
            (path, _Block(replay, i, b)) for i, (path, b) in enumerate(zip(paths, replay.blocks))
        ]
        layers.append(("head", _Head(replay, head_owned)))
        layered = LayeredModel(
            name,
            layers,
            task,
            vocab_size=vocab_size,
            num_classes=num_classes,
            in_channels=in_channels,
        )
        adopt_root_tensors(model, layered, example)
        check_reproduces(replay, layered, example)
    follow_root_mode(layered, model)
    return layered


def _learn_calls(
    replay: Replay, example: torch.Tensor, expected: list[tuple[Any, Any, Any]]
) -> None:
    """Record how each block is called, and refuse a model replay splitting would change."""
    for index, (_args, _kwargs, out) in enumerate(expected):
        if isinstance(out, torch.Tensor):
            arity = 0
        elif isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
            # Only the hidden state travels on; split_at_blocks checks that the forward
            # needs nothing else of what a block returns.
            arity = len(out)
        else:
            raise PipeswapError(
                f"block {replay.paths[index]!r} returns {type(out).__name__}; blocks must "
                "return a tensor or a tuple whose first item is the hidden state"
            )
        spec = pytree.tree_flatten(((), {}))[1]
        replay.calls.append(_BlockCall(spec, [], arity, isinstance(out, list)))
    for index in range(1, len(expected)):
        previous_out = expected[index - 1][2]
        previous = previous_out if isinstance(previous_out, torch.Tensor) else previous_out[0]
        if hidden_of(expected[index][0], expected[index][1]) is not previous:
            raise PipeswapError(
                f"the model's forward transforms the output of block "
                f"{replay.paths[index - 1]!r} before block {replay.paths[index]!r} gets it; "
                "pipeswap cuts only where blocks feed each other directly: name blocks that "
                "include that code"
            )
    try:
        hidden, received = replay.capture(example)
    except PipeswapError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own code, whatever it raises
        raise PipeswapError(
            f"the model's forward fails with its blocks stubbed ({type(exc).__name__}: {exc}); "
            "it reads more of a block's output than the hidden state: name other blocks"
        ) from exc
    context_index = {key: i for i, key in enumerate(context_of(hidden, received))}
    for index, ((args, kwargs), (want_args, want_kwargs, _out)) in enumerate(
        zip(received, expected)
    ):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        want_leaves, want_spec = pytree.tree_flatten((want_args, want_kwargs))
        where = f"block {replay.paths[index]!r}"
        if spec != want_spec:
            raise PipeswapError(
                f"{where} is called differently when earlier blocks are skipped; its "
                "arguments depend on their outputs, so pipeswap cannot cut there"
            )
        sources: list[_Source] = []
        for position, (leaf, want) in enumerate(zip(leaves, want_leaves)):
            if isinstance(leaf, torch.Tensor):
                if leaf is hidden:
                    sources.append(_Source("hidden"))
                    continue
                if not isinstance(want, torch.Tensor) or not same_tensor(leaf, want):
                    raise PipeswapError(
                        f"{where} receives a tensor that depends on earlier blocks' outputs "
                        f"(argument leaf {position}); pipeswap cannot cut there"
                    )
                sources.append(_Source("context", context_index[id(leaf)]))
            elif isinstance(leaf, _CONSTANT_TYPES):
                sources.append(_Source("constant", leaf))
            else:
                raise PipeswapError(
                    f"{where} receives a {type(leaf).__name__}; pipeswap passes tensors and "
                    "constants between stages (for Hugging Face models it sets use_cache=False)"
                )
        learned = replay.calls[index]
        replay.calls[index] = _BlockCall(spec, sources, learned.output_arity, learned.output_list)
    replay.num_context = len(context_index)
