"""Tests of byte-size parsing and formatting (pipeswap.units)."""

import pytest

from pipeswap.errors import PipeswapError
from pipeswap.units import MAX_BYTES, format_bytes, format_ratio_at_most, parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GiB", 16 * 2**30),
        ("16GB", 16 * 10**9),
        ("1.5e9", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("4096", 4096),
        ("1.5 gib", 3 * 2**29),
        ("2kb", 2000),
        ("0", 0),
        (" 7 B ", 7),
        ("1TiB", 2**40),
        (12, 12),
        (2e9, 2 * 10**9),
    ],
)
def test_parse_bytes(text, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("lots", "not a byte size"),
        ("16 gigs", "unknown unit 'gigs'"),
        ("-1GB", "not a byte size"),
        ("0.5", "whole number"),
        ("", "not a byte size"),
        (float("nan"), "finite"),
    ],
)
def test_parse_bytes_refuses_nonsense(text, message: str) -> None:
    with pytest.raises(PipeswapError, match=message):
        parse_bytes(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("1e300GiB", "'1e300GiB' is larger than 2\\*\\*63 - 1 bytes"),
        ("1e400", "'1e400'; a byte size must be a finite number >= 0"),
        ("inf", "'inf'; a byte size must be a finite number >= 0"),
        ("nan", "'nan'; a byte size must be a finite number >= 0"),
        ("-1GiB", "'-1GiB'; a byte size must be a finite number >= 0"),
        ("9223372036854775808", "'9223372036854775808' is larger than 2\\*\\*63 - 1 bytes"),
        ("8589934592GiB", "'8589934592GiB' is larger than 2\\*\\*63 - 1 bytes"),
        (1e300, "1e\\+300 is larger than 2\\*\\*63 - 1 bytes"),
        (2**70, "1180591620717411303424 is larger"),
        (-1, "-1; a byte size must be a finite number >= 0"),
        (float("inf"), "inf; a byte size must be a finite number >= 0"),
    ],
)
def test_parse_bytes_refuses_sizes_no_machine_has(text, message: str) -> None:
    with pytest.raises(PipeswapError, match=message):
        parse_bytes(text)


def test_parse_bytes_keeps_whole_numbers_exact_up_to_the_limit() -> None:
    assert MAX_BYTES == 2**63 - 1
    assert parse_bytes(str(MAX_BYTES)) == MAX_BYTES == parse_bytes(MAX_BYTES)
    assert parse_bytes("8589934591GiB") == 8589934591 * 2**30


def test_an_oversized_budget_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeswap.cli import main

    argv = ["train", "--model", "gpt2-micro", "--device", "cpu", "--gpu-memory", "1e300GiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "'1e300GiB' is larger than 2**63 - 1 bytes" in err
    assert "Traceback" not in err


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(16 * 2**30) == "16.00 GiB"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(5 * 10**9, binary=False) == "5.00 GB"
    assert format_bytes(3 * 2**50) == "3072.00 TiB"
    assert parse_bytes(format_bytes(512 * 2**20).replace(" ", "")) == 512 * 2**20


def test_a_ratio_at_most_is_rounded_down_so_that_it_is_accepted() -> None:
    peak, smallest = 1702011, 1548128  # 1.09940...: 1.100 would give a budget below smallest
    assert format_ratio_at_most(peak, smallest) == "1.099"
    assert int(peak / float(format_ratio_at_most(peak, smallest))) >= smallest
    assert format_ratio_at_most(3000, 1000) == "3.000"
