"""What was made from arrays, reused while the very same arrays come back: the engine's weight syncs."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class ReuseByIdentity:
    """Values made from tuples of source arrays, reused by the next pass that brings the same arrays (an RL weight
    sync that trains adapters or float layers hands the packed weights back unchanged, and remaking what the engine
    derives from them would cost a copy each time).

    Ids are unique only while their arrays live, so the arrays are kept beside what was made from them and compared
    by identity. A pass (`begin`, `get`s, `commit`) keeps only what it used; one that fails before its commit leaves
    the last committed pass's record as it was.
    """

    def __init__(self):
        self._kept: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}
        self._used: dict[tuple[int, ...], tuple[tuple[Any, ...], Any]] = {}

    def begin(self) -> None:
        self._used = {}

    def get(self, sources: tuple[Hashable | None, ...], make: Callable[[], T]) -> T:
        """What `make` made from these very `sources` in the last committed pass, else make()."""
        key = tuple(map(id, sources))
        old = self._kept.get(key)
        value = old[1] if old is not None and all(a is b for a, b in zip(old[0], sources)) else make()
        self._used[key] = (sources, value)
        return value

    def commit(self) -> None:
        self._kept, self._used = self._used, {}
