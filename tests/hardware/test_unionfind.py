"""Disjoint sets: unions are transitive, repeats are reported, groups keep the given order.

Covers: pipeswap/hardware/unionfind.py.
"""

from __future__ import annotations

import doctest
import random

import pytest

from pipeswap.hardware import unionfind
from pipeswap.hardware.unionfind import UnionFind


def test_union_reports_whether_it_joined_two_sets() -> None:
    sets = UnionFind(range(5))
    assert sets.union(0, 1) and sets.union(3, 1)
    assert not sets.union(0, 3)  # already one set: the link that would close a cycle
    assert sets.find(0) == sets.find(3) != sets.find(2)
    assert sets.groups() == [[0, 1, 3], [2], [4]]


def test_groups_keep_the_order_items_were_given_in() -> None:
    sets = UnionFind(["gpu3", "gpu1", "gpu2", "gpu0"])
    sets.union("gpu0", "gpu1")
    sets.union("gpu2", "gpu3")
    assert sets.groups() == [["gpu3", "gpu2"], ["gpu1", "gpu0"]]


def test_matches_connected_components_of_random_graphs() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 30)
        edges = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(0, 2 * n))]
        sets = UnionFind(range(n))
        for a, b in edges:
            sets.union(a, b)
        # Reference: grow each component by repeated relaxation.
        label = list(range(n))
        changed = True
        while changed:
            changed = False
            for a, b in edges:
                low = min(label[a], label[b])
                if label[a] != low or label[b] != low:
                    label[a] = label[b] = low
                    changed = True
        expected: dict[int, list[int]] = {}
        for item in range(n):
            expected.setdefault(label[item], []).append(item)
        assert sets.groups() == list(expected.values())


def test_unknown_item_and_empty_sets() -> None:
    with pytest.raises(KeyError):
        UnionFind([1, 2]).find(3)
    assert UnionFind[int]().groups() == []


def test_docstring_example() -> None:
    outcome = doctest.testmod(unionfind)
    assert outcome.attempted > 0 and outcome.failed == 0
