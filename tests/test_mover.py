"""The Mover: ordered asynchronous page copies between the tiers' tensors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shadowradix.tiers.mover import ThreadMover, page_runs


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), max_size=20))
def test_page_runs_cover_every_pair_once_in_order(pairs):
    src = np.array([s for s, _ in pairs], dtype=np.int32)
    dst = np.array([d for _, d in pairs], dtype=np.int32)
    rebuilt = [(s + i, d + i) for s, d, n in page_runs(src, dst) for i in range(n)]
    assert rebuilt == pairs


def pools(pages: int = 12):
    g = torch.Generator().manual_seed(0)
    t = {(name, tier): torch.zeros(3, pages, 4, 2) for name in ("a", "b") for tier in (0, 1)}
    for name in ("a", "b"):
        t[(name, 1)].copy_(torch.randn(3, pages, 4, 2, generator=g))
    return t


@pytest.mark.parametrize("workers", [1, 3])
def test_copies_land_in_submission_order(workers):
    """A host page loaded to the device, then overwritten on the host by a later backup:
    the load must see the old content (FIFO), and the final state is exact."""
    t = pools()
    mover = ThreadMover(lambda name, tier: t[(name, tier)], workers=workers)
    before = t[("a", 1)][:, 5].clone()
    first = mover.submit([("a", 1, np.array([5, 6, 7, 9]), np.array([0, 1, 2, 3]))])
    t[("a", 0)][:, 4] = 7.0  # device page 4 written before the backup is submitted
    second = mover.submit([("a", 0, np.array([4]), np.array([5]))])  # backup over host page 5
    mover.wait(second)
    assert mover.done(first) and mover.idle
    assert torch.equal(t[("a", 0)][:, 0], before)
    assert torch.equal(t[("a", 1)][:, 5], torch.full_like(before, 7.0))
    assert mover.bytes_moved == 5 * t[("a", 0)][:, 0].numel() * 4
    mover.close()


def test_a_failed_copy_is_reported_not_swallowed():
    """Reported once by `failures` (the HostTier forgets its pages), never wedging."""
    t = pools()
    mover = ThreadMover(lambda name, tier: t[(name, tier)], workers=1)
    bad = mover.submit([("a", 1, np.array([99]), np.array([0]))])  # no page 99
    mover.wait(bad)
    (ticket, error), = mover.failures(bad)
    assert ticket == bad and isinstance(error, IndexError | RuntimeError)
    ok = mover.submit([("a", 1, np.array([0]), np.array([0]))])
    assert mover.failures(ok) == []
    mover.close()
