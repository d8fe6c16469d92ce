"""One page allocator per pool.

A pool owns its free list and nothing else: which pages a request or the tree
holds is theirs to know. Pages are int32 ids in `[0, num_pages)`; -1 is never
a page (it is the tree's tombstone).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shadowradix.layout.spec import PoolSpec

if TYPE_CHECKING:
    from shadowradix.pool.storage import PoolStorage

PAGE_DTYPE = np.int32


def checked_free(name: str, in_use: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """`pages` as int32 ids, each in range and marked in use in `in_use` (the caller marks
    them free). Raises ValueError on an id out of range or not in use, or ids that are not
    integers (an empty array of any type frees nothing)."""
    given = np.asarray(pages)
    if given.dtype != PAGE_DTYPE and given.size:
        if given.dtype.kind not in "iu":
            # A mask (bool) or floats: as ids they would name other pages (True is page 1).
            raise ValueError(f"pool {name!r}: page ids must be integers, got {given.dtype} "
                             f"in free()")
        if given.min() < 0 or given.max() >= in_use.size:  # before a cast wraps it
            raise ValueError(f"pool {name!r}: page ids out of range in free()")
    pages = given.astype(PAGE_DTYPE, copy=False).ravel()
    if pages.size == 0:
        return pages
    try:  # as unsigned, a negative id is out of range instead of wrapping around
        used = in_use[pages.view(np.uint32)]
    except IndexError:
        raise ValueError(f"pool {name!r}: page ids out of range in free()") from None
    if np.count_nonzero(used) < used.size:
        raise ValueError(f"pool {name!r}: double free of pages "
                         f"{pages[~in_use[pages]][:8].tolist()}")
    return pages


def page_count(name: str, n: object) -> int:
    """`n` as a count of pages to allocate: an int >= 0 (numpy's too, not a bool or a
    float). Raises ValueError naming the pool, before anything changes."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"pool {name!r}: pages to allocate must be an int >= 0, got {n!r}")
    return int(n)


class PoolExhausted(RuntimeError):
    """`alloc` was asked for more pages than are free. Call `can_alloc` first."""


class PagePool:
    """Free-list allocator for one pool's physical pages.

    With `storage` the pages are backed by a tensor; without, the pool is
    metadata-only (the simulator sizes terabyte pools this way).
    """

    def __init__(self, spec: PoolSpec, page_size: int, num_pages: int,
                 storage: PoolStorage | None = None) -> None:
        if num_pages < 0:
            raise ValueError(f"pool {spec.name!r}: num_pages must be >= 0, got {num_pages}")
        if num_pages >= np.iinfo(PAGE_DTYPE).max:
            raise ValueError(f"pool {spec.name!r}: {num_pages} pages exceed int32 page ids")
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        self.storage = storage
        # Stack of free ids; the low ids are handed out first.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=PAGE_DTYPE)
        self._top = num_pages
        self._in_use = np.zeros(num_pages, dtype=bool)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._top

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self._top

    def alloc(self, n: int) -> np.ndarray:
        """Take `n` free pages. Raises PoolExhausted (changing nothing) if fewer are free,
        ValueError for a count that is not an int >= 0; any other fault, an interrupt too,
        changes nothing either."""
        n = page_count(self.name, n)
        top = self._top
        if n > top:
            raise PoolExhausted(f"pool {self.name!r}: asked for {n} pages, {top} free")
        pages = self._free[top - n:top][::-1].copy()
        try:  # a fault (an interrupt too) changes nothing
            self._in_use[pages] = True
            self._top = top - n
            return pages
        except BaseException:
            self._in_use[pages] = False
            self._top = top
            raise

    def free(self, pages: np.ndarray) -> None:
        """Return pages. Raises ValueError (changing nothing) on a page not in use; any
        other fault, an interrupt too, changes nothing either.

        Ids repeated within one call are not detected here (that would cost a
        sort per call); `check_integrity` finds the duplicate in the free list.
        """
        pages = checked_free(self.name, self._in_use, pages)
        if pages.size == 0:
            return
        top = self._top
        try:  # a fault (an interrupt too) changes nothing
            self._in_use[pages] = False
            self._free[top:top + pages.size] = pages
            self._top = top + pages.size
        except BaseException:
            self._in_use[pages] = True
            self._top = top
            raise

    def in_use(self, pages: np.ndarray) -> np.ndarray:
        """Boolean mask: which of `pages` are allocated."""
        return self._in_use[np.asarray(pages, dtype=PAGE_DTYPE)]

    def check_integrity(self) -> None:
        free = self._free[:self._top]
        if np.unique(free).size != free.size:
            raise AssertionError(f"pool {self.name!r}: free list holds duplicates")
        if self._in_use[free].any():
            raise AssertionError(f"pool {self.name!r}: free list holds pages marked in use")
        if int(self._in_use.sum()) != self.used_pages:
            raise AssertionError(f"pool {self.name!r}: {int(self._in_use.sum())} pages marked in "
                                 f"use but {self.used_pages} allocated")
