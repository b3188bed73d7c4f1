"""ReuseByIdentity: a pass reuses what the last committed pass made from the very same arrays, and only that."""

import numpy as np

from tunix_rt.models.array_reuse import ReuseByIdentity


class Maker:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()


def one_pass(reuse, sources, make):
    reuse.begin()
    values = [reuse.get(s, make) for s in sources]
    reuse.commit()
    return values


def test_the_same_arrays_reuse_what_was_made_and_equal_copies_do_not():
    a, b = np.arange(4), np.arange(3)
    reuse, make = ReuseByIdentity(), Maker()
    first = one_pass(reuse, [(a, b), (b, None)], make)
    assert make.calls == 2
    again = one_pass(reuse, [(a, b), (b, None)], make)
    assert make.calls == 2 and all(x is y for x, y in zip(first, again))
    copied = one_pass(reuse, [(a.copy(), b), (b, None)], make)  # equal contents, another array: made anew
    assert make.calls == 3 and copied[0] is not first[0] and copied[1] is first[1]


def test_a_pass_keeps_only_what_it_used():
    a, b = np.arange(4), np.arange(5)
    reuse, make = ReuseByIdentity(), Maker()
    one_pass(reuse, [(a,), (b,)], make)
    one_pass(reuse, [(a,)], make)  # b's value is dropped here
    one_pass(reuse, [(a,), (b,)], make)
    assert make.calls == 3


def test_a_pass_that_fails_before_its_commit_leaves_the_last_record():
    a, b = np.arange(4), np.arange(5)
    reuse, make = ReuseByIdentity(), Maker()
    (kept,) = one_pass(reuse, [(a,)], make)
    reuse.begin()
    reuse.get((b,), make)  # a pass that never commits (its caller raised)
    assert one_pass(reuse, [(a,)], make) == [kept] and make.calls == 2
