"""pipeswap/training/loop_new_shapes.py: a call cut to shorter rows, and the longest that fit.

The refusal that names the longest rows is tested end to end in
tests/training/test_loop_shapes.py (a Llama's 4x256 batch over a small budget)."""

from __future__ import annotations

from typing import Any

import torch

from pipeswap.training.loop_new_shapes import longest_rows, with_rows


def _call(rows: int, length: int) -> tuple[Any, Any]:
    ids = torch.arange(rows * length).view(rows, length)
    return (ids,), {"attention_mask": torch.ones(rows, length), "labels": ids, "n": 3}


def test_every_tensor_of_the_row_length_is_cut_and_nothing_else() -> None:
    args, kwargs = _call(2, 10)
    kwargs["other"] = torch.zeros(2, 7)
    (ids,), cut = with_rows((args, kwargs), 10, 4)
    assert ids.tolist() == [[0, 1, 2, 3], [10, 11, 12, 13]]
    assert cut["attention_mask"].shape == cut["labels"].shape == (2, 4)
    assert cut["other"].shape == (2, 7) and cut["n"] == 3


def test_the_longest_rows_that_fit_by_a_binary_search() -> None:
    asked: list[int] = []

    def fits(call: tuple[Any, Any]) -> bool:
        length = int(call[0][0].shape[1])
        asked.append(length)
        return length <= 37

    assert longest_rows(_call(4, 256), fits) == (4, 37)
    assert len(asked) <= 8  # log2(256) forwards, not one per length
    assert longest_rows(_call(4, 256), lambda call: False) is None
    assert longest_rows(((torch.zeros(5),), {}), fits) is None  # no rows to shorten
    # Images: a batch of floats alone has no rows (its second dimension is the channels).
    images = ((torch.zeros(8, 3, 64, 64),), {"labels": torch.zeros(8, dtype=torch.long)})
    assert longest_rows(images, lambda call: True) is None
