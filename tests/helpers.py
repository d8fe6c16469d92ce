"""Shared test fixtures: tiny layouts, page contents derived from tokens, rule checks."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.tiers import PrefixCache
from shadowradix.tree import MatchResult


def tiny_layout(page_size: int = 4, window: int = 3, *, all_pools: bool = True,
                window_pool: bool = True, state: bool = True) -> KVLayout:
    """A DeepSeek-V4-shaped layout at toy scale: raw + 2:1 ALL pools, a window, a state."""
    pools = []
    if all_pools:
        pools += [PoolSpec("kv", 1, Retention.ALL, (2,), "float32", 1),
                  PoolSpec("c2", 2, Retention.ALL, (2,), "float32", 1)]
    if window_pool:
        pools.append(PoolSpec("swa", 1, Retention.WINDOW, (2,), "float32", 1, window=window))
    if state:
        pools.append(PoolSpec("state", None, Retention.CHECKPOINT, (3,), "float32", 1))
    return KVLayout("tiny", tuple(pools), page_size)


def page_key(tokens: np.ndarray | list[int], page: int, row: int, page_size: int) -> int:
    """What a page must hold: a function of the pool and every token up to the page's end.
    A page served for the wrong prefix (or the wrong pool) shows up as a mismatch."""
    prefix = np.asarray(tokens[:(page + 1) * page_size], dtype=np.int32).tobytes()
    return zlib.crc32(prefix, row * 7919 + 1)


def needed_pages(layout: KVLayout, resume_pages: int) -> dict[int, list[int]]:
    """Per row, the pages a request resuming at `resume_pages` reads (the match rule)."""
    out: dict[int, list[int]] = {}
    q = resume_pages
    for row, spec in enumerate(layout.pools):
        if q == 0:
            out[row] = []
        elif spec.retention is Retention.ALL:
            out[row] = list(range(q))
        elif spec.retention is Retention.WINDOW:
            out[row] = list(range(max(q - spec.window_pages(layout.page_size), 0), q))
        else:
            out[row] = [q - 1]
    return out


def assert_sound(cache: PrefixCache, tokens: list[int], m: MatchResult,
                 content: list[dict[int, int]]) -> None:
    """Every page a match returns holds the data written for exactly those tokens, and
    the pages the resume needs are all there."""
    ps = cache.layout.page_size
    q = m.prefix_len // ps
    assert m.prefix_len % ps == 0 and m.prefix_len <= max(len(tokens) - 1, 0)
    assert m.prefix_len <= m.logical_len
    assert m.page_table.shape == (len(cache.layout.pools), q)
    for row, pages in needed_pages(cache.layout, q).items():
        for i in pages:
            assert m.page_table[row, i] >= 0, f"row {row} page {i} missing at resume {q}"
    for row in range(len(cache.layout.pools)):
        for i in range(q):
            page = int(m.page_table[row, i])
            if page >= 0:
                assert content[row].get(page) == page_key(tokens, i, row, ps), (
                    f"pool row {row}: page {page} at logical page {i} holds other data")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def serve(cache: PrefixCache, tokens: list[int], content: list[dict[int, int]] | None = None,
          *, insert: bool = True) -> tuple[MatchResult, int]:
    """One whole request: match, lock, allocate, write, insert, unlock.

    Writes each allocated page's expected key into `content`. Returns the
    match and how many pages the tree already held at insert.
    """
    ps = cache.layout.page_size
    m = cache.match(tokens)
    handle = cache.lock(m)
    done, full = m.prefix_len // ps, len(tokens) // ps
    total = -(-len(tokens) // ps)
    need = {p.name: (full if p.ratio is None else total) - done for p in cache.layout.pools}
    got = cache.alloc(need)
    assert got is not None, "test pools too small for this request"
    own = np.empty((len(cache.layout.pools), full - done), dtype=np.int32)
    partial = {}
    for row, spec in enumerate(cache.layout.pools):
        own[row] = got[spec.name][:full - done]
        partial[spec.name] = got[spec.name][full - done:]
        if content is not None:
            for i, page in enumerate(got[spec.name].tolist()):
                content[row][page] = page_key(tokens, done + i, row, ps)
    cached = 0
    if insert:
        cached = cache.insert(tokens, own, done).cached_pages
        cache.free(partial)
    else:
        cache.free(got)
    cache.unlock(handle)
    return m, cached


def fail_at(monkeypatch: Any, owner: object, attr: str, nth: int,
            kind: type[BaseException] = RuntimeError) -> list[int]:
    """Make `owner.attr` raise `kind` on its nth call (1-based) for the rest of the test;
    returns the call counter (one cell), so a test can assert the point was reached."""
    original = getattr(owner, attr)
    calls = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == nth:
            raise kind(f"injected at {attr} call {nth}")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attr, failing)
    return calls


class LineFault:
    """An interrupt (or `kind`) raised at the `nth` line (1-based) run in any of `codes`'
    functions, nested calls into them included, while the `with` block runs: a signal
    arriving between two statements. `lines` counts the lines run (a run with `nth` 0
    only counts), `hit` says whether it fired."""

    def __init__(self, codes: Any, nth: int = 0,
                 kind: type[BaseException] = KeyboardInterrupt) -> None:
        self.codes = {getattr(c, "__code__", c) for c in codes}
        self.nth, self.kind = nth, kind
        self.lines, self.hit = 0, False

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not self.hit:
            self.lines += 1
            if self.lines == self.nth:
                self.hit = True
                raise self.kind(f"injected at {frame.f_code.co_name}:{frame.f_lineno}")
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if frame.f_code in self.codes else None

    def __enter__(self) -> LineFault:
        import sys

        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys

        sys.settrace(None)


class DoubleFault:
    """Two interrupts while the `with` block runs: the first at the `nth` line run in
    `codes`' functions (as LineFault), the second at the `k`th call made after it into or
    from those functions (a second signal arriving inside the handler of the first: calls
    are where Python delivers signals). `hits` counts those that struck; `where` says
    where."""

    def __init__(self, codes: Any, nth: int, k: int) -> None:
        self.codes = {getattr(c, "__code__", c) for c in codes}
        self.nth, self.k = nth, k
        self.lines = self.calls = self.hits = 0
        self.where: list[str] = []

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not self.hits:
            self.lines += 1
            if self.lines == self.nth:
                import sys

                self.hits = 1
                self.where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                sys.setprofile(self._profile)  # (CPython drops a trace that raised)
                raise KeyboardInterrupt(f"first at {self.where[-1]}")
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        return self._local if frame.f_code in self.codes else None

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if self.hits != 1 or event != "call":
            return
        back = frame.f_back
        if frame.f_code not in self.codes and (back is None or back.f_code not in self.codes):
            return
        self.calls += 1
        if self.calls == self.k:
            self.hits = 2
            self.where.append(f"call {frame.f_code.co_name}")
            raise KeyboardInterrupt(f"second at {self.where[-1]}")

    def __enter__(self) -> DoubleFault:
        import sys

        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys

        sys.settrace(None)
        sys.setprofile(None)


def interrupted_copies(codes: Any, world: Any, run: Any) -> Any:
    """For every line `run(world)` goes through in `codes`' functions (counted on a copy):
    a deep copy of `world` that `run` was cut short in by an interrupt at that line,
    yielded as (nth line, copy) for the caller to check what the fault left."""
    import copy

    with LineFault(codes) as count:
        run(copy.deepcopy(world))
    assert count.lines > 0, "the run went through none of the functions"
    for nth in range(1, count.lines + 1):
        trial = copy.deepcopy(world)
        raised = False
        with LineFault(codes, nth) as fault:
            try:
                run(trial)
            except KeyboardInterrupt:
                raised = True
        assert fault.hit and raised, nth  # it struck, and nothing swallowed it
        yield nth, trial


class CallFault:
    """`kind` raised at the `nth` call of a builtin named `name` (a list's `append`: memory
    running out as the list grows) made from `func`'s own code, while the `with` block
    runs. `hit` says whether it fired."""

    def __init__(self, func: Any, name: str, nth: int = 1,
                 kind: type[BaseException] = MemoryError, event: str = "c_call") -> None:
        self.code, self.name, self.nth, self.kind = func.__code__, name, nth, kind
        self.event = event  # "c_return": as the call returns (an interrupt right after it)
        self.calls, self.hit = 0, False

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if (event == self.event and not self.hit and frame.f_code is self.code
                and getattr(arg, "__name__", "") == self.name):
            self.calls += 1
            if self.calls == self.nth:
                self.hit = True
                raise self.kind(f"injected at {self.name} in {self.code.co_name}")

    def __enter__(self) -> CallFault:
        import sys

        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys

        sys.setprofile(None)
