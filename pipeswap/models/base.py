"""LayeredModel: a network as an ordered list of named blocks, ready to profile and cut."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class LayeredModel(nn.Sequential):
    """A model whose forward is its blocks applied in order, one tensor passed between them.

    Every zoo model is one, so the profiler can time each block and the pipeline can cut
    contiguous stages (``model.stage(3, 7)``). ``task`` says what the output means:

    - ``"lm"``: input token ids ``[B, T]`` (int64), output logits ``[B, T, V]``,
      target the next tokens ``[B, T]``;
    - ``"classify"``: input images ``[B, C, H, W]``, output logits ``[B, K]``, target ``[B]``.
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
    ) -> None:
        super().__init__(OrderedDict(blocks))
        if task not in ("lm", "classify"):
            raise ValueError(f"task must be 'lm' or 'classify', not {task!r}")
        self.name = name
        self.task = task
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        self.in_channels = in_channels

    @property
    def layer_names(self) -> list[str]:
        return list(self._modules.keys())

    def stage(self, start: int, stop: int) -> nn.Sequential:
        """Blocks ``start`` (inclusive) to ``stop`` (exclusive), sharing their parameters."""
        names = self.layer_names[start:stop]
        return nn.Sequential(OrderedDict((n, self._modules[n]) for n in names))

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``output`` against ``target`` for this model's task."""
        if self.task == "lm":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
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
        if self.task == "lm":
            if seq_len is None:
                raise ValueError(f"{self.name} is a language model: pass seq_len")
            if device.type == "meta":
                tokens = torch.empty(batch, seq_len, dtype=torch.long, device=device)
                return tokens, torch.empty(batch, seq_len, dtype=torch.long, device=device)
            gen = torch.Generator().manual_seed(seed)
            data = torch.randint(0, self.vocab_size, (batch, seq_len + 1), generator=gen)
            return data[:, :-1].to(device), data[:, 1:].to(device)
        if image_size is None:
            raise ValueError(f"{self.name} is an image model: pass image_size")
        shape = (batch, self.in_channels, image_size, image_size)
        if device.type == "meta":
            images = torch.empty(shape, dtype=dtype, device=device)
            return images, torch.empty(batch, dtype=torch.long, device=device)
        gen = torch.Generator().manual_seed(seed)
        images = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
        labels = torch.randint(0, self.num_classes, (batch,), generator=gen).to(device)
        return images, labels
