"""What was made from arrays, reused while the very same arrays come back: the engine's weight syncs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
Reuse = Callable[[tuple[object, ...], Callable[[], T]], T]


class ReuseByIdentity:
    """Values made from tuples of source arrays, reused by the next pass that brings the same arrays (an RL weight
    sync that trains adapters or float layers hands the packed weights back unchanged, and remaking what the engine
    derives from them would cost a copy each time).

    Ids are unique only while their arrays live, so the arrays are kept beside what was made from them and compared
    by identity. A pass keeps only what it used; one that raises keeps nothing of its own and leaves the last
    finished pass's record as it was.
    """

    def __init__(self):
        self._kept: dict[tuple[int, ...], tuple[tuple[object, ...], Any]] = {}

    @contextlib.contextmanager
    def sweep(self) -> Iterator[Reuse]:
        """One pass: yields reuse(sources, make), which returns what `make` made from these very `sources` in the
        last finished pass, else make(). The pass's record replaces the last one when the block ends cleanly."""
        used: dict[tuple[int, ...], tuple[tuple[object, ...], Any]] = {}

        def reuse(sources: tuple[object, ...], make: Callable[[], T]) -> T:
            key = tuple(map(id, sources))
            old = self._kept.get(key)
            value = old[1] if old is not None and all(a is b for a, b in zip(old[0], sources)) else make()
            used[key] = (sources, value)
            return value

        yield reuse
        self._kept = used
