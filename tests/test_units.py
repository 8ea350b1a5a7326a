"""Tests of byte-size parsing and formatting (pipeswap.units)."""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30), ("16GB", 16 * 10**9), ("1.5e9", 1_500_000_000),
        ("512MiB", 512 * 2**20), ("4096", 4096), ("1.5 gib", 3 * 2**29), ("2kb", 2000),
        ("0", 0), (" 7 B ", 7), ("1TiB", 2**40), (12, 12), (2e9, 2 * 10**9),
    ],
)
def test_parse_bytes(text, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [("lots", "not a byte size"), ("16 gigs", "unknown unit 'gigs'"), ("-1GB", "not a byte size"),
     ("0.5", "whole number"), ("", "not a byte size"), (float("nan"), "finite")],
)
def test_parse_bytes_refuses_nonsense(text, message: str) -> None:
    with pytest.raises(PipeswapError, match=message):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(16 * 2**30) == "16.00 GiB"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(5 * 10**9, binary=False) == "5.00 GB"
    assert format_bytes(3 * 2**50) == "3072.00 TiB"
    assert parse_bytes(format_bytes(512 * 2**20).replace(" ", "")) == 512 * 2**20
