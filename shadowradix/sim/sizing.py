"""Pool sizes from a byte budget, using the layout's real bytes per page."""

from __future__ import annotations

from shadowradix.layout.spec import KVLayout, Retention

GB = 1 << 30


def pages_for_budget(layout: KVLayout, budget_bytes: float, window_ratio: float) -> dict[str, int]:
    """Split `budget_bytes` so every ALL / CHECKPOINT pool gets N pages and every WINDOW
    pool `window_ratio * N` (SGLang sizes its SWA pool the same way, 0.1 by default).

    A conventional cache keeps the window for every cached token: window_ratio 1.
    """
    if budget_bytes < 0 or not 0 < window_ratio <= 1:
        raise ValueError(f"need budget >= 0 and 0 < window_ratio <= 1, got {budget_bytes}, "
                         f"{window_ratio}")
    per_page = layout.page_bytes()
    unit = sum(b * (window_ratio if p.retention is Retention.WINDOW else 1.0)
               for p, b in zip(layout.pools, per_page.values(), strict=True))
    n = int(budget_bytes // unit)
    return {p.name: int(n * window_ratio) if p.retention is Retention.WINDOW else n
            for p in layout.pools}


def budget_bytes(pages: dict[str, int], layout: KVLayout) -> int:
    """Bytes the pools take at these sizes (the inverse check of pages_for_budget)."""
    per_page = layout.page_bytes()
    return sum(per_page[name] * n for name, n in pages.items())


def pages_for_shared_budget(layout: KVLayout, budget_bytes: float) -> dict[str, int]:
    """Page ceilings for pools that share one byte budget (PrefixCache(budget=...)): the
    most pages each pool could ever hold. ALL pools grow together (a cached page needs all
    of them), so they share one ceiling; a short-lived pool may take the whole budget."""
    if budget_bytes < 0:
        raise ValueError(f"need budget >= 0, got {budget_bytes}")
    per_page = layout.page_bytes()
    unit = sum(per_page[p.name] for p in layout.pools if p.retention is Retention.ALL)
    return {p.name: int(budget_bytes // (unit if p.retention is Retention.ALL
                                         else per_page[p.name]))
            for p in layout.pools}
