"""The head layer's second run of the model's own forward, without a trace of the first part.

The head runs the model's forward again with its blocks stubbed (pipeswap.models.replay),
so the code before the first block runs a second time in each step: its output is dropped
at the stubs, or read by a skip connection into the code after the blocks. That second run
must compute what the first computed and change nothing the model's own forward would not:

- it runs in the modules' own modes (a BatchNorm in training normalises by the batch, as
  in the first run: in eval mode it would use its running statistics, and a skip into the
  head would read other values than the model's forward does);
- the buffers it updates (BatchNorm's statistics, a step counter) are put back, at the
  first block, as they were before it: the code after the blocks reads them as the model's
  forward does, and they update once per step;
- the random generators are rewound, at the first block, to where they stood before it:
  what the code before the blocks draws again is dropped, and the code after the blocks
  draws what the model's forward would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["rerun_quietly"]


@contextmanager
def rerun_quietly(
    modules: Sequence[nn.Module], device: torch.device
) -> Iterator[Callable[[], None]]:
    """Around the head's re-run of the forward: ``modules``' own buffers put back after it
    where it changed them, and the callback it yields, called at the first block's stub,
    rewinds the random generators (the CPU's, and ``device``'s) to where they stood."""
    # A module in training mode may update its buffers in a kernel that leaves their
    # version as it was (BatchNorm's statistics): those are put back whatever it says.
    # Others are put back where their version moved (a counter's add_): a buffer that
    # did not change is not written, as autograd may have saved it (an eval BatchNorm's).
    seen = {id(b): (b, m.training) for m in modules for b in m.buffers(recurse=False)}
    kept = [(b, b.clone(), b._version, training) for b, training in seen.values()]
    cpu_state = torch.get_rng_state()
    device_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    rewound = False

    def put_back() -> None:
        for buffer, before, version, training in kept:
            if training or buffer._version != version:
                # Through .data: autograd may hold the buffer for the first run's backward
                # (BatchNorm's does), and this write is none of its business.
                buffer.data.copy_(before)

    def at_first_block() -> None:
        nonlocal rewound
        if rewound:
            return
        rewound = True
        # The code after the blocks reads the buffers as the model's forward left them
        # (a counter bumped before the blocks, read by the head), and updates them once.
        put_back()
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)

    try:
        yield at_first_block
    finally:
        if not rewound:
            put_back()
