import numpy as np
import pytest

from shadowradix.layout import PoolSpec, Retention
from shadowradix.pool import PagePool, PoolExhausted

SPEC = PoolSpec("kv", 1, Retention.ALL, (2,), "float32", 2)


def test_alloc_free_roundtrip_and_refusal_changes_nothing():
    pool = PagePool(SPEC, 4, 5)
    assert pool.can_alloc(5) and not pool.can_alloc(6)
    a = pool.alloc(3)
    assert sorted(a.tolist()) == [0, 1, 2] and pool.free_pages == 2
    with pytest.raises(PoolExhausted):
        pool.alloc(3)
    assert pool.free_pages == 2
    pool.free(a[:1])
    b = pool.alloc(3)
    assert len(set(a[1:].tolist()) | set(b.tolist())) == 5
    pool.check_integrity()


def test_double_free_and_bad_ids_are_refused_without_change():
    pool = PagePool(SPEC, 4, 4)
    a = pool.alloc(2)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a[:1])
    with pytest.raises(ValueError, match="out of range"):
        pool.free(np.array([-1]))
    with pytest.raises(ValueError, match="out of range"):
        pool.free(np.array([4]))
    assert pool.free_pages == 4
    pool.check_integrity()


@pytest.mark.parametrize("kind", ["pages", "arena"])
@pytest.mark.parametrize("ids", [np.array([True, False]), [True, True], np.array([1.0]),
                                 np.array([0.5, 1.5])])
def test_ids_that_are_not_integers_are_refused_without_change(kind, ids):
    """A mask or floats given to `free`: before, True and 1.0 freed page 1 (and False page
    0), another owner's pages."""
    if kind == "pages":
        pool = PagePool(SPEC, 4, 4)
    else:
        from shadowradix.layout import KVLayout
        from shadowradix.pool.arena import Arena

        layout = KVLayout("one", (SPEC,), 4)
        pool = Arena(layout, 4 * SPEC.page_bytes(4)).pools()["kv"]
    got = pool.alloc(4)
    with pytest.raises(ValueError, match="must be integers"):
        pool.free(ids)
    assert pool.free_pages == 0 and pool.in_use(got).all()
    pool.free(np.empty(0))  # nothing, of any type, frees nothing
    pool.free(got)
    pool.check_integrity()


def test_metadata_only_pool_sizes_terabytes_without_memory():
    pool = PagePool(SPEC, 256, 50_000_000)  # no storage: only the free list exists
    assert pool.storage is None and pool.alloc(10).size == 10


def test_torch_storage_shape_and_addressing():
    import torch

    from shadowradix.pool.storage import PoolStorage

    spec = PoolSpec("c2", 2, Retention.ALL, (3,), "float32", 2)
    st = PoolStorage(spec, 8, 5)
    assert tuple(st.data.shape) == (2, 5, 4, 3) and st.data.dtype == torch.float32
    flat = st.flat(1)
    pages = torch.tensor([4, 2])
    idx = spec.entry_index(pages, torch.tensor([0, 7, 9]), 8)
    flat[idx] = torch.tensor([[1.0] * 3, [2.0] * 3, [3.0] * 3])
    assert st.data[1, 4, 0, 0] == 1 and st.data[1, 4, 3, 0] == 2 and st.data[1, 2, 0, 0] == 3
