"""DataConfig: what a run trains on, the built-in data or the user's own files."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pipeswap.config_fields import option, require

__all__ = ["DataConfig", "UserData"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data of a run and its held-out split: ``data`` None trains on the built-in data
    (pipeswap.data); a path trains a language model on the user's own tokens or text
    (pipeswap.user_data), an encoder-decoder on its source/target pairs
    (pipeswap.user_pairs), whose last 5% is held out unless ``eval_data`` names the
    held-out data (then every window of ``data`` trains). ``eval_batches`` held-out
    batches are scored after training, in every mode."""

    data: str | None = option(
        None,
        metavar="PATH",
        help="train on your own data: for language models .bin/.npy tokens, .txt files or a "
        "folder of them, .jsonl, .csv, .parquet, .arrow, or a save_to_disk directory; for "
        "image models a folder with one sub-folder of images per class; for encoder-decoders "
        ".jsonl, .csv or .parquet with {source_field} and {target_field}; 5%% of it is held "
        "out (default: the built-in data)",
    )
    text_field: str = option("text", help="the field holding the text in JSON lines and tables")
    source_field: str | None = option(
        None,
        metavar="FIELD",
        help="encoder-decoders (T5, BART): the field of {data} holding each example's input "
        "text, with {target_field}",
    )
    target_field: str | None = option(
        None,
        metavar="FIELD",
        help="encoder-decoders: the field of {data} holding the text to generate from "
        "{source_field}'s",
    )
    eval_data: str | None = option(
        None,
        metavar="PATH",
        help="held-out data in any {data} format, scored after training (default: the last "
        "5%% of {data}; with it, all of {data} trains)",
    )
    eval_batches: int = option(
        2,
        help="held-out batches (of {batch} samples) scored after training, by each "
        "data-parallel rank (the report counts them all); 0: none",
    )
    eval_every: int = option(
        0,
        metavar="N",
        help="score the {eval_batches} held-out batches every N steps too, not only at the "
        "end (0: at the end only)",
    )

    def __post_init__(self) -> None:
        require(self.data != "", "{data} is empty; name a file or a directory")
        require(self.text_field != "", "{text_field} is empty; name the field with the text")
        require(self.eval_data != "", "{eval_data} is empty; name a file or a directory")
        for name, value in (
            ("source_field", self.source_field),
            ("target_field", self.target_field),
        ):
            require(value != "", f"{{{name}}} is empty; name the field")
        require(
            (self.source_field is None) == (self.target_field is None),
            "{source_field} and {target_field} go together: give both, the fields of each "
            "example's input and output text",
        )
        require(
            self.source_field is None or self.data is not None,
            "{source_field} and {target_field} name fields of {data}: give {data} PATH too",
        )
        require(
            self.source_field is None or self.source_field != self.target_field,
            f"{{source_field}} and {{target_field}} are both {self.source_field!r}; name the "
            "input's field and the output's",
        )
        require(
            self.eval_data is None or self.data is not None,
            "{eval_data} is held-out data for {data}: give {data} PATH too, or drop {eval_data}",
        )
        require(self.eval_batches >= 0, f"{{eval_batches}} is {self.eval_batches}; use 0 or more")
        require(self.eval_every >= 0, f"{{eval_every}} is {self.eval_every}; use 0 or more")
        require(
            self.eval_every == 0 or self.eval_batches > 0,
            "{eval_every} scores the held-out batches, but {eval_batches} is 0: give "
            "{eval_batches} 1 or more, or drop {eval_every}",
        )

    def eval_due(self, step: int, steps: int) -> bool:
        """Whether the held-out batches are scored after optimizer step ``step`` (0-based)
        of a ``steps``-step run, before its end (the end's score is always taken)."""
        return self.eval_every > 0 and (step + 1) % self.eval_every == 0 and step + 1 < steps

    def source(self, split: str) -> UserData | None:
        """Where the user's ``split`` (train or val) comes from, or None for the built-in
        data: a path, its text field and the part of it (``train``/``val``: the first 95%
        and the last 5%; ``all``: every window)."""
        if self.data is None:
            return None
        if self.eval_data is None:
            return UserData(self.data, self.text_field, split)
        return UserData(self.data if split == "train" else self.eval_data, self.text_field, "all")


class UserData(NamedTuple):
    """A user's data file or directory, the field of its text, and which windows to use."""

    path: str
    text_field: str
    part: str
