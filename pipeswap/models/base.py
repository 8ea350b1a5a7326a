"""LayeredModel: a network as an ordered list of named blocks, ready to profile and cut."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from pipeswap.config_fields import ConfigError
from pipeswap.models.tasks import TASKS, Task, task_kind
from pipeswap.models.written import written_back

__all__ = ["IGNORE_INDEX", "LayeredModel", "evaluating", "init_convs_"]

# Targets equal to this are not scored (the unmasked positions of a masked LM).
IGNORE_INDEX = -100


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` scoring held-out data: eval mode (no dropout, BatchNorm on its running
    statistics) and no gradients; every submodule's own mode comes back afterwards, and
    what an eval forward writes into the model (pipeswap.models.written)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad(), written_back(module):
            yield
    finally:
        for m, mode in modes:
            m.train(mode)


def _add_layers(sequential: nn.Sequential, layers: Sequence[tuple[str, nn.Module]]) -> None:
    """Register layers under their names, which may be dotted module paths (``h.0``).

    ``add_module`` refuses dots because ``get_submodule`` splits on them; the names of a
    LayeredModel's layers are module paths of the model it adapts, so they go into
    ``_modules`` directly (iteration, parameters, state dicts and ``.to()`` all work).
    """
    for name, module in layers:
        if not name or name in sequential._modules or hasattr(nn.Sequential, name):
            raise ValueError(f"layer name {name!r} is empty, repeated or reserved")
        sequential._modules[name] = module


class LayeredModel(nn.Sequential):
    """A model whose forward is its blocks applied in order, one tensor passed between them.

    Every model pipeswap trains is one (zoo models are built as one; a user's module is
    cut into one by pipeswap.models.adapt), so the profiler can time each block and the
    pipeline can cut contiguous stages (``model.stage(3, 7)``). ``task`` says what the
    output means (its entry, :attr:`task_entry`, says what follows: pipeswap.models.tasks):

    - ``"lm"``: input token ids ``[B, T]`` (int64), output logits ``[B, T, V]``,
      target the next tokens ``[B, T]``; with ``mask_token_id`` set it is a masked LM:
      some input tokens are replaced by that id and the targets are the original tokens
      there and IGNORE_INDEX elsewhere (pipeswap.data.MaskedLMDataset);
    - ``"classify"``: input images ``[B, C, H, W]``, output logits ``[B, K]``, target ``[B]``.

    Layer names may be dotted module paths (``transformer.h.0``) of the model a
    LayeredModel adapts (pipeswap.models.adapt).
    """

    def __init__(
        self,
        name: str,
        blocks: Sequence[tuple[str, nn.Module]],
        task: str,
        *,
        vocab_size: int = 0,
        num_classes: int = 0,
        in_channels: int = 3,
        mask_token_id: int | None = None,
    ) -> None:
        super().__init__()
        _add_layers(self, blocks)
        if task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
        self.name = name
        self.task = task
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.in_channels = in_channels
        self.mask_token_id = mask_token_id
        # Set by adapters: the one image size a model takes (ViT), its longest sequence.
        self.fixed_image_size: int | None = None
        # Whether its input is token ids (a language model, a sequence classifier).
        self.takes_tokens = self.task_entry.takes_tokens
        self.max_positions: int | None = None

    @property
    def task_entry(self) -> Task:
        """The entry of :attr:`task` in the task table (pipeswap.models.tasks)."""
        return task_kind(self.task)

    @property
    def layer_names(self) -> list[str]:
        return list(self._modules.keys())

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """nn.Module's, with the key check done on whole keys: torch's own check splits a
        key at its first dot, which a dotted layer name (``transformer.h.0``) breaks, so
        every key of an adapted model would read as unexpected though all load."""
        super().load_state_dict(state_dict, strict=False, assign=assign)
        expected = self.state_dict().keys()
        missing = [key for key in expected if key not in state_dict]
        unexpected = [key for key in state_dict if key not in expected]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__} {self.name}: "
                f"missing keys {missing[:5]}, unexpected keys {unexpected[:5]}"
            )
        return _IncompatibleKeys(missing, unexpected)

    def stage(self, start: int, stop: int) -> nn.Sequential:
        """Blocks ``start`` (inclusive) to ``stop`` (exclusive), sharing their parameters."""
        stage = nn.Sequential()
        _add_layers(stage, [(n, self._modules[n]) for n in self.layer_names[start:stop]])
        return stage

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``output`` against ``target`` for this model's task."""
        if self.task_entry.per_position:
            return F.cross_entropy(
                output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX
            )
        return F.cross_entropy(output, target)

    def example_batch(
        self,
        batch: int,
        *,
        seq_len: int | None = None,
        image_size: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random inputs and targets of the right shapes (meta device gives meta tensors)."""
        device = torch.device(device)
        task = self.task_entry
        if task.takes_tokens:
            if seq_len is None:
                raise ConfigError(f"{self.name} is {task.noun}: pass {{seq_len}}")
            if device.type == "meta":
                tokens = torch.empty(batch, seq_len, dtype=torch.long, device=device)
                return tokens, torch.empty(batch, seq_len, dtype=torch.long, device=device)
            gen = torch.Generator().manual_seed(seed)
            data = torch.randint(0, self.vocab_size, (batch, seq_len + 1), generator=gen)
            return data[:, :-1].to(device), data[:, 1:].to(device)
        if image_size is None:
            raise ConfigError(f"{self.name} is {task.noun}: pass {{image_size}}")
        shape = (batch, self.in_channels, image_size, image_size)
        if device.type == "meta":
            images = torch.empty(shape, dtype=dtype, device=device)
            return images, torch.empty(batch, dtype=torch.long, device=device)
        gen = torch.Generator().manual_seed(seed)
        images = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        labels = torch.randint(0, self.num_classes, (batch,), generator=gen).to(device)
        return images, labels


def init_convs_(module: nn.Module) -> None:
    """He et al.'s initialisation of every convolution (Kaiming normal, fan-out, ReLU gain;
    zero biases), which keeps the activations' scale through a deep stack of ReLU
    convolutions (ResNet, VGG)."""
    for sub in module.modules():
        if isinstance(sub, nn.Conv2d):
            nn.init.kaiming_normal_(sub.weight, mode="fan_out", nonlinearity="relu")
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
