"""Disjoint sets (union-find) of hashable items: connected groups and cycle checks."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["UnionFind"]

T = TypeVar("T", bound=Hashable)


class UnionFind(Generic[T]):
    """``items`` in disjoint sets: ``union`` joins two sets, ``find`` names an item's set.

    >>> sets = UnionFind("abcd")
    >>> sets.union("c", "a"), sets.union("a", "c")
    (True, False)
    >>> sets.groups()
    [['a', 'c'], ['b'], ['d']]
    """

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._parent: dict[T, T] = {item: item for item in items}

    def find(self, item: T) -> T:
        """The representative of ``item``'s set (KeyError for an item not given)."""
        parent = self._parent
        while parent[item] != item:
            parent[item] = parent[parent[item]]  # path halving keeps later finds short
            item = parent[item]
        return item

    def union(self, a: T, b: T) -> bool:
        """Join the sets of ``a`` and ``b``; False when they already were one set."""
        root_a, root_b = self.find(a), self.find(b)
        if root_a == root_b:
            return False
        self._parent[root_a] = root_b
        return True

    def groups(self) -> list[list[T]]:
        """Every set as a list; items, and sets by their first item, in the order given."""
        out: dict[T, list[T]] = {}
        for item in self._parent:
            out.setdefault(self.find(item), []).append(item)
        return list(out.values())
