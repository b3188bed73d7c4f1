"""ReuseByIdentity: a pass reuses what the last finished pass made from the very same arrays, and only that."""

import gc
import weakref

import numpy as np
import pytest

from tunix_rt.models.array_reuse import ReuseByIdentity


class Maker:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()


def one_pass(cache, sources, make):
    with cache.sweep() as reuse:
        return [reuse(s, make) for s in sources]


def test_the_same_arrays_reuse_what_was_made_and_equal_copies_do_not():
    a, b = np.arange(4), np.arange(3)
    cache, make = ReuseByIdentity(), Maker()
    first = one_pass(cache, [(a, b), (b, None)], make)
    assert make.calls == 2
    again = one_pass(cache, [(a, b), (b, None)], make)
    assert make.calls == 2 and all(x is y for x, y in zip(first, again))
    copied = one_pass(cache, [(a.copy(), b), (b, None)], make)  # equal contents, another array: made anew
    assert make.calls == 3 and copied[0] is not first[0] and copied[1] is first[1]


def test_a_pass_keeps_only_what_it_used():
    a, b = np.arange(4), np.arange(5)
    cache, make = ReuseByIdentity(), Maker()
    one_pass(cache, [(a,), (b,)], make)
    one_pass(cache, [(a,)], make)  # b's value is dropped here
    one_pass(cache, [(a,), (b,)], make)
    assert make.calls == 3


def test_a_pass_that_raises_keeps_nothing_and_leaves_the_last_record():
    a, b = np.arange(4), np.arange(5)
    cache, make = ReuseByIdentity(), Maker()
    (kept,) = one_pass(cache, [(a,)], make)
    with pytest.raises(RuntimeError), cache.sweep() as reuse:
        reuse((b,), make)
        raise RuntimeError("the caller's pass failed")
    assert one_pass(cache, [(a,)], make) == [kept] and make.calls == 2
    one_pass(cache, [(b,)], make)  # what the failed pass made was not recorded
    assert make.calls == 3


def test_the_record_keeps_its_arrays_alive_so_their_ids_stay_theirs():
    a = np.arange(4)
    alive = weakref.ref(a)
    cache, make = ReuseByIdentity(), Maker()
    one_pass(cache, [(a,)], make)
    del a
    gc.collect()
    assert alive() is not None
    one_pass(cache, [], make)  # a pass that no longer uses it lets it go
    gc.collect()
    assert alive() is None
