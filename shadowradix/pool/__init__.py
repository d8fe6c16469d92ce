"""Physical pages: one allocator per pool, optional tensor storage."""

from shadowradix.pool.allocator import PAGE_DTYPE, PagePool, PoolExhausted

__all__ = ["PAGE_DTYPE", "PagePool", "PoolExhausted"]
