"""DataConfig: what a run trains on, the built-in data or the user's own files."""

from __future__ import annotations

from dataclasses import dataclass

from pipeswap.config import option, require


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The data of a run: ``data`` None trains on the built-in data (pipeswap.data); a
    path trains a language model on the user's own tokens or text (pipeswap.user_data)."""

    data: str | None = option(
        None,
        metavar="PATH",
        help="train on your own data (language models): .bin/.npy tokens, .txt files or a "
        "folder of them, .jsonl, .csv, .parquet, .arrow, or a save_to_disk directory; the "
        "last 5%% of it is held out (default: the built-in data)",
    )
    text_field: str = option("text", help="the field holding the text in JSON lines and tables")

    def __post_init__(self) -> None:
        require(self.data != "", "{data} is empty; name a file or a directory")
        require(self.text_field != "", "{text_field} is empty; name the field with the text")

    @property
    def source(self) -> tuple[str, str] | None:
        """(path, text field) of the user's data, or None for the built-in data."""
        return None if self.data is None else (self.data, self.text_field)
