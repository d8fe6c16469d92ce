"""The arena (pool/arena.py) against brute-force models.

    plan        plan_frames on random small layouts and the DeepSeek-V4 presets: every
                pool's slab fits the frame, strides are whole entries, and the frame is
                the one the docstring promises (checked by enumerating every candidate).
    machine     Arena + ArenaPool under random allocs and frees (and bad frees) against
                a model that tracks which pages and frames each pool holds.
    tensors     PoolStorage.over views of one arena tensor: every page of every pool is
                its own bytes, and the two addressing paths (data, flat) agree.
    manager     the CacheManager machines (test_manager_machine.py) over an arena, with
                and without a host tier: content checks hold; a refusal may only evict.
"""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import numpy as np
import pytest
from conftest import STEPS
from helpers import tiny_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_manager_machine import ManagerMachine, Running
from test_tiers_machine import ContentMover
from test_tree_machine import PS, steps

from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.layout.presets import named_layout
from shadowradix.layout.spec import DTYPE_BYTES
from shadowradix.pool.allocator import PAGE_DTYPE, PoolExhausted
from shadowradix.pool.arena import FREE, MAX_GROWTH, Arena, plan_frames
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.manager import CacheManager

FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


# ------------------------------------------------------------------ layouts
@st.composite
def layouts(draw: st.DrawFn, packed: bool = True, dtypes: tuple[str, ...] = tuple(DTYPE_BYTES),
            max_dim: int = 5) -> KVLayout:
    """A random small layout: 1-4 pools of any retention, entry shape and dtype; with
    `packed`, sometimes one with a packed (metadata-only) entry size."""
    ps = draw(st.sampled_from([1, 2, 4, 8, 16]))
    divisors = [d for d in range(1, ps + 1) if ps % d == 0]
    n = draw(st.integers(1, 4))
    pack = packed and draw(st.integers(0, 3)) == 0
    pools = []
    for i in range(n):
        retention = draw(st.sampled_from(list(Retention)))
        ratio = None if retention is Retention.CHECKPOINT else draw(st.sampled_from(divisors))
        shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=1, max_size=3)))
        window = draw(st.integers(1, 12)) if retention is Retention.WINDOW else 0
        override = draw(st.integers(1, 40)) if pack and draw(st.booleans()) else None
        pools.append(PoolSpec(f"p{i}", ratio, retention, shape, draw(st.sampled_from(dtypes)),
                              draw(st.integers(1, 3)), window=window,
                              entry_bytes_override=override))
    return KVLayout("random", tuple(pools), ps)


def _cut_brute(frame: int, page: int, entry: int) -> int:
    """The most pages of `page` bytes in `frame` at one stride dividing it that is a
    multiple of `entry` (0: none): by trying every count."""
    return max((k for k in range(1, frame // page + 1)
                if frame % k == 0 and (frame // k) % entry == 0), default=0)


def check_plan(layout: KVLayout, names: list[str] | None) -> None:
    plan = plan_frames(layout, names)
    ps = layout.page_size
    specs = [p for p in layout.pools if names is None or p.name in names]
    assert set(plan.per_frame) == set(plan.stride) == {p.name for p in specs}
    page = {p.name: p.page_bytes(ps) for p in specs}
    largest = max(page.values())
    fb = plan.frame_bytes
    assert fb >= largest
    packed = any(p.entry_bytes_override is not None for p in specs)
    for p in specs:
        k, stride = plan.per_frame[p.name], plan.stride[p.name]
        assert k >= 1, p.name
        assert stride >= page[p.name], (p.name, stride, page[p.name])
        assert stride * k <= fb
        assert 0 <= plan.slack(p.name, page[p.name]) < 1
        if not packed:
            assert stride * k == fb, (p.name, stride, k, fb)
            assert stride % p.entry_bytes == 0, (p.name, stride, p.entry_bytes)
            # every page of the slab is a whole number of the dtype's elements apart
            assert stride % DTYPE_BYTES[p.dtype] == 0
    if packed:  # metadata-only: the frame is the largest page, as many pages as fit
        assert fb == largest
        assert all(plan.per_frame[n] == largest // b for n, b in page.items())
        return
    # The frame the docstring promises: from the largest page up in steps of the largest
    # page's entry, the first of least mean slack (or the first under 1%), each pool cut
    # as finely as alignment allows; with none within MAX_GROWTH, a frame every entry
    # size divides, cut as finely (one page of each pool per frame wasted up to 99.75% of
    # it: an attack's layout with pages of 16, 512 and 400 bytes).
    step = next(p.entry_bytes for p in specs if page[p.name] == largest)
    candidates = {}
    frame = -(-largest // step) * step
    while frame <= MAX_GROWTH * largest:
        cut = {p.name: _cut_brute(frame, page[p.name], p.entry_bytes) for p in specs}
        if all(cut.values()):
            candidates[frame] = (sum(frame - cut[n] * b for n, b in page.items())
                                 / (len(specs) * frame), cut)
        frame += step
    if not candidates:
        lcm = math.lcm(*(p.entry_bytes for p in specs))
        assert fb == lcm * -(-largest // lcm)
        assert plan.per_frame == {p.name: _cut_brute(fb, page[p.name], p.entry_bytes)
                                  for p in specs}
        return
    assert fb in candidates, f"frame {fb} is not an aligned candidate"
    waste, cut = candidates[fb]
    assert plan.per_frame == cut, "a pool is cut coarser than alignment allows"
    for frame, (w, _) in candidates.items():
        if frame < fb:
            assert w >= waste - 1e-12 and w >= 0.01 - 1e-12, (frame, w, fb, waste)
        elif frame > fb and waste >= 0.01:
            assert w >= waste - 1e-12, (frame, w, fb, waste)


@FAST
@given(layout=layouts(), data=st.data())
def test_plan_frames_random(layout: KVLayout, data: st.DataObject) -> None:
    names = None
    if data.draw(st.booleans()):
        names = data.draw(st.lists(st.sampled_from(layout.pool_names), min_size=1,
                                   unique=True))
    check_plan(layout, names)


@pytest.mark.parametrize("name", ["deepseek-v4-pro", "deepseek-v4-flash"])
@pytest.mark.parametrize("dtype", ["fp8", "bfloat16"])
@pytest.mark.parametrize("page_size", [128, 256])
def test_plan_frames_presets(name: str, dtype: str, page_size: int) -> None:
    layout = named_layout(name, page_size, dtype)
    check_plan(layout, None)
    check_plan(layout, [n for n in layout.pool_names if n != "c4"])  # C4 in host memory
    plan = plan_frames(layout)
    page = layout.page_bytes()
    slack = [plan.slack(n, page[n]) for n in layout.pool_names]
    assert max(slack) < 0.1 and sum(slack) / len(slack) < 0.05, slack  # "a few percent"


def test_plan_frames_no_pool() -> None:
    with pytest.raises(ValueError):
        plan_frames(tiny_layout(), [])


def test_arena_constructor() -> None:
    layout = tiny_layout(PS, window=5)
    fb = plan_frames(layout).frame_bytes
    for bad in (-1, True, 3.0 * fb, "1000"):
        with pytest.raises(ValueError):
            Arena(layout, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Arena(layout, fb - 1)
    with pytest.raises(ValueError):
        Arena(layout, 3 * fb, reserved_bytes=3 * fb)
    arena = Arena(layout, 5 * fb + fb - 1, reserved_bytes=fb + 1)  # 2 frames set apart
    assert (arena.frames, arena.reserved_frames, arena.free_frames) == (3, 2, 3)
    pools = arena.pools()
    assert set(pools) == set(layout.pool_names)
    for pool in pools.values():
        assert pool.num_pages == 3 * pool.per_frame == pool.free_pages
    assert arena.stats(pools)["reserved_bytes"] == 2 * fb
    sub = Arena(layout, 4 * fb, names=["kv", "state"])
    assert set(sub.pools()) == {"kv", "state"} and sub.names == ("kv", "state")


# ---------------------------------------------------------- arena machine
FIXED = [
    tiny_layout(PS, window=5),
    tiny_layout(8, window=3),
    KVLayout("packed", (
        PoolSpec("a", 1, Retention.ALL, (1,), "uint8", 1, entry_bytes_override=5),
        PoolSpec("b", 4, Retention.ALL, (1,), "uint8", 2, entry_bytes_override=3),
        PoolSpec("s", None, Retention.CHECKPOINT, (1,), "uint8", 1, entry_bytes_override=7),
    ), 4),
]


def bad_free_ids(data: st.DataObject, pool: Any, held: set[int], how: str,
                 most_negative: int = 5) -> list[int] | None:
    """Ids a free must refuse (`how`: double, range, negative or huge: past int32) mixed
    with pages in use, in a drawn order; None where `double` finds no idle page."""
    if how == "double":
        idle = [p for p in range(pool.num_pages) if p not in held]
        if not idle:
            return None
        bad = [data.draw(st.sampled_from(idle))]
    elif how == "range":
        bad = [pool.num_pages + data.draw(st.integers(0, 5))]
    elif how == "negative":
        bad = [-data.draw(st.integers(1, most_negative))]
    else:
        bad = [2**31 + data.draw(st.integers(0, 5))]
    good = data.draw(st.lists(st.sampled_from(sorted(held)), unique=True)) if held else []
    return data.draw(st.permutations(good + bad))


class ArenaMachine(RuleBasedStateMachine):
    """Arena + ArenaPool against a model: per pool the set of pages held, per frame its
    owner (or none). Everything the arena reports is recomputed from the model."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = -1

    @initialize(data=st.data())
    def make(self, data: st.DataObject) -> None:
        # mostly the fixed layouts: a few pages per frame, so frames are often part-filled
        layout = data.draw(st.sampled_from(FIXED) if data.draw(st.integers(0, 3)) else layouts())
        names = None
        if data.draw(st.booleans()):
            names = data.draw(st.lists(st.sampled_from(layout.pool_names), min_size=1,
                                       unique=True))
        fb = plan_frames(layout, names).frame_bytes
        frames = data.draw(st.integers(1, 8))
        reserved = data.draw(st.integers(0, 2)) * fb
        extra = data.draw(st.integers(0, fb - 1))
        self.arena = Arena(layout, (frames + reserved // fb) * fb + extra, names=names,
                           reserved_bytes=reserved)
        assert self.arena.frames == frames
        self.pools = self.arena.pools()
        self.names = sorted(self.pools)
        self.held: dict[str, set[int]] = {n: set() for n in self.names}
        self.owner: dict[int, str] = {}  # frame -> pool holding it
        # per pool, its free slots in held frames as a stack (the top last)
        self.stack: dict[str, list[int]] = {n: [] for n in self.names}

    # ------------------------------------------------------------- model
    def _k(self, name: str) -> int:
        return self.pools[name].per_frame

    def _frames_of(self, name: str) -> list[int]:
        return sorted(f for f, n in self.owner.items() if n == name)

    def _used_in(self, name: str, frame: int) -> int:
        k = self._k(name)
        return sum(1 for p in self.held[name] if p // k == frame)

    def _slots(self, name: str) -> int:
        return len(self._frames_of(name)) * self._k(name) - len(self.held[name])

    def _free_frames(self) -> int:
        return self.arena.frames - len(self.owner)

    def _capacity(self, name: str) -> int:
        return self._slots(name) + self._free_frames() * self._k(name)

    def _snapshot(self) -> tuple:
        a = self.arena
        return (a.owner.tobytes(), a.free_frames, a._free[:a.free_frames].tobytes(),
                tuple((p.used_pages, p.frames_held, p._in_use.tobytes(),
                       p._slots[:p.slots_free].tobytes()) for p in self.pools.values()))

    # ------------------------------------------------------------- rules
    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names))
        pool, k = self.pools[name], self._k(name)
        cap = self._capacity(name)
        n = data.draw(st.one_of(st.integers(0, min(cap, 3 * k)), st.integers(0, cap + k)))
        if n > cap:
            before = self._snapshot()
            with pytest.raises(PoolExhausted):
                pool.alloc(n)
            assert self._snapshot() == before, "a refused alloc changed the books"
            return
        slots = self._slots(name)
        mine = self._frames_of(name)
        pages = pool.alloc(n)
        assert pages.dtype == PAGE_DTYPE and pages.shape == (n,)
        ids = pages.tolist()
        assert len(set(ids)) == n, "one alloc returned a page twice"
        assert not set(ids) & self.held[name], "alloc returned a page already in use"
        assert all(0 <= p < pool.num_pages for p in ids)
        frames = {p // k for p in ids}
        new = frames - set(mine)
        assert not new & set(self.owner), "alloc took a frame another pool holds"
        assert len(new) == (-(-(n - slots) // k) if n > slots else 0), "frames over-taken"
        # the slot freed last first, then new frames' slots in order, the rest left free
        stack = self.stack[name]
        taken = min(n, len(stack))
        want = stack[len(stack) - taken:][::-1]
        del stack[len(stack) - taken:]
        fresh = list(dict.fromkeys(p // k for p in ids[taken:]))
        assert set(fresh) == new
        slots_new = [f * k + j for f in fresh for j in range(k)]
        want += slots_new[:n - taken]
        stack += slots_new[n - taken:][::-1]
        assert ids == want, f"pool {name}: took {ids}, the free stack says {want}"
        self.held[name] |= set(ids)
        for f in new:
            self.owner[f] = name

    @rule(data=st.data())
    def alloc_negative(self, data: st.DataObject) -> None:
        pool = self.pools[data.draw(st.sampled_from(self.names))]
        before = self._snapshot()
        with pytest.raises(ValueError):
            pool.alloc(-data.draw(st.integers(1, 3)))
        assert self._snapshot() == before
        assert not pool.can_alloc(-1)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([n for n in self.names if self.held[n]]))
        pool, k = self.pools[name], self._k(name)
        held = sorted(self.held[name])
        pages = data.draw(st.one_of(
            st.lists(st.sampled_from(held), unique=True),
            st.permutations(held)))
        freed_frames_model = set()
        self.held[name] -= set(pages)
        for f in {p // k for p in pages}:
            if not any(p // k == f for p in self.held[name]):
                freed_frames_model.add(f)
                del self.owner[f]
        if k > 1:  # the slots of frames going back leave the stack; the others go on top
            stack = [p for p in self.stack[name] if p // k not in freed_frames_model]
            self.stack[name] = stack + [p for p in pages if p // k not in freed_frames_model]
        pool.free(np.asarray(pages, dtype=data.draw(st.sampled_from([np.int32, np.int64]))))
        for f in freed_frames_model:
            assert self.arena.owner[f] == FREE, f"frame {f} not returned with its last page"

    @rule(data=st.data(), how=st.sampled_from(["double", "range", "negative"]))
    def bad_free(self, data: st.DataObject, how: str) -> None:
        name = data.draw(st.sampled_from(self.names))
        pool = self.pools[name]
        pages = bad_free_ids(data, pool, self.held[name], how)
        if pages is None:
            return
        before = self._snapshot()
        with pytest.raises(ValueError):
            pool.free(np.asarray(pages, dtype=np.int64))
        assert self._snapshot() == before, f"a refused free ({how}) changed the books"

    @rule(data=st.data())
    def frames_short(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.names), unique=True))
        need = {n: data.draw(st.integers(0, self._capacity(n) + self._k(n))) for n in chosen}
        model = sum(-(-(m - self._slots(n)) // self._k(n)) for n, m in need.items()
                    if m > self._slots(n)) - self._free_frames()
        before = self._snapshot()
        short = self.arena.frames_short(self.pools, need)
        assert self._snapshot() == before
        assert short == model, (need, short, model)
        _, pools = copy.deepcopy((self.arena, self.pools))  # every need, one by one
        try:
            for n, m in need.items():
                pools[n].alloc(m)
            fits = True
        except PoolExhausted:
            fits = False
        assert fits == (short <= 0), (need, short)

    # -------------------------------------------------------- invariants
    @invariant()
    def books(self) -> None:
        if not hasattr(self, "arena"):
            return
        self.steps += 1
        arena, fb = self.arena, self.arena.plan.frame_bytes
        arena.check_integrity(self.pools)
        assert arena.free_frames == self._free_frames()
        assert sum(p.frames_held for p in self.pools.values()) + arena.free_frames == (
            arena.frames)
        want = np.full(arena.frames, FREE)
        for f, n in self.owner.items():
            want[f] = self.pools[n].row
        assert np.array_equal(arena.owner, want), "frame owners disagree with the model"
        ps = arena.layout.page_size
        held_bytes = used_bytes = slack = holes = 0
        for n, pool in self.pools.items():
            k = pool.per_frame
            assert pool.used_pages == len(self.held[n])
            assert pool.frames_held == len(self._frames_of(n))
            assert pool.slots_free == self._slots(n)
            assert pool._slots[:pool.slots_free].tolist() == self.stack[n], "free slot stack"
            assert pool.free_pages == pool.slots_free + arena.free_frames * k == (
                self._capacity(n))
            assert pool.can_alloc(self._capacity(n)) and not pool.can_alloc(
                self._capacity(n) + 1)
            mask = np.zeros(pool.num_pages, dtype=bool)
            mask[list(self.held[n])] = True
            assert np.array_equal(pool.in_use(np.arange(pool.num_pages)), mask)
            page = pool.spec.page_bytes(ps)
            held_bytes += pool.frames_held * fb
            used_bytes += pool.used_pages * page
            slack += pool.frames_held * (fb - k * page)
            holes += pool.slots_free * page
        stats = arena.stats(self.pools)
        assert stats["free_frames"] == arena.free_frames and stats["frames"] == arena.frames
        assert stats["used_bytes"] == used_bytes
        assert stats["fragmented_bytes"] == held_bytes - used_bytes == slack + holes
        for n, pool in self.pools.items():
            s = stats["pools"][n]
            assert s["frames"] == pool.frames_held and s["bytes"] == pool.frames_held * fb
            assert s["free_slots"] == pool.slots_free and s["per_frame"] == pool.per_frame

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        if not hasattr(self, "arena"):
            return
        for n, pool in self.pools.items():
            pool.free(np.asarray(sorted(self.held[n]), dtype=PAGE_DTYPE))
            assert pool.used_pages == 0 and pool.frames_held == 0
        assert self.arena.free_frames == self.arena.frames
        self.arena.check_integrity(self.pools)


TestArenaMachine = ArenaMachine.TestCase
TestArenaMachine.settings = steps(30)


def test_frame_returns_with_last_page() -> None:
    """A frame goes back exactly when its last page does, and is then free for another
    pool; the slot a free gave back last fills first."""
    layout = tiny_layout(PS, window=5)  # per frame: kv 1, c2 3, swa 1, state 4
    arena = Arena(layout, 3 * plan_frames(layout).frame_bytes)
    pools = arena.pools()
    c2, kv = pools["c2"], pools["kv"]
    a = c2.alloc(5)  # two frames: 3 + 2
    assert c2.frames_held == 2 and arena.free_frames == 1
    first = a[:3]
    c2.free(first[:2])
    assert c2.frames_held == 2  # one page of the first frame is left
    got = c2.alloc(1)  # the frame just opened (1 used) fills before the other (2 used)
    assert int(got[0]) // 3 == int(first[0]) // 3
    c2.free(np.concatenate([first[2:], got]))  # the first frame's last pages
    assert c2.frames_held == 1 and arena.free_frames == 2 and c2.slots_free == 1
    kv.alloc(2)
    assert arena.free_frames == 0 and c2.free_pages == 1 and not c2.can_alloc(2)
    with pytest.raises(PoolExhausted):
        c2.alloc(2)
    arena.check_integrity(pools)


def test_the_slot_freed_last_fills_first() -> None:
    """Free slots are a stack: the slot freed last is taken first, whatever frame it is in;
    the slots of a frame that went back are gone from it."""
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 3 * plan_frames(layout).frame_bytes)
    pools = arena.pools()
    c2 = pools["c2"]  # 3 pages a frame
    pages = c2.alloc(6).tolist()
    f0, f1 = pages[0] // 3, pages[3] // 3
    c2.free(np.array([pages[0]]))  # f0
    c2.free(np.array([pages[3]]))  # then f1
    c2.free(np.array([pages[1]]))  # f0 again: on top
    arena.check_integrity(pools)
    assert c2.alloc(1).tolist() == [pages[1]]
    assert c2.alloc(2).tolist() == [pages[3], pages[0]]
    assert c2.slots_free == 0
    c2.free(np.array([pages[4], pages[1]]))  # f1, f0
    c2.free(np.array([pages[0], pages[2]]))  # f0 goes back: pages[1] leaves the stack
    assert c2.frames_held == 1 and c2.slots_free == 1 and arena.owner[f0] == FREE
    assert c2.alloc(1).tolist() == [pages[4]] and int(pages[4]) // 3 == f1
    arena.check_integrity(pools)


# ---------------------------------------------------------------- tensors
def _byte_offset(arena: Arena, t) -> int:  # type: ignore[no-untyped-def]
    return t.data_ptr() - arena.data.data_ptr()  # type: ignore[union-attr]


@settings(FAST, max_examples=60)
@given(layout=layouts(packed=False, dtypes=("float32", "float16", "bfloat16", "int8", "uint8"),
                      max_dim=3),
       data=st.data())
def test_storage_views_do_not_alias(layout: KVLayout, data: st.DataObject) -> None:
    import torch

    fb = plan_frames(layout).frame_bytes
    arena = Arena(layout, data.draw(st.integers(1, 4)) * fb, device="cpu")
    pools = arena.pools()
    held: dict[str, list[int]] = {n: [] for n in pools}
    for _ in range(data.draw(st.integers(1, 8))):  # random allocs and frees, then check
        name = data.draw(st.sampled_from(sorted(pools)))
        pool = pools[name]
        if held[name] and data.draw(st.booleans()):
            drop = data.draw(st.lists(st.sampled_from(held[name]), unique=True))
            pool.free(np.asarray(drop, dtype=PAGE_DTYPE))
            held[name] = [p for p in held[name] if p not in drop]
        else:
            n = data.draw(st.integers(0, min(pool.free_pages, 12)))
            held[name] += pool.alloc(n).tolist()
    arena.check_integrity(pools)
    ps = layout.page_size
    spans = []
    for name, pool in pools.items():
        storage, spec, k = pool.storage, pool.spec, pool.per_frame
        assert storage is not None and storage.data.dtype == getattr(torch, spec.dtype)
        epp = spec.entries_per_page(ps)
        assert storage.data.shape == (spec.layers, pool.num_pages, epp, *spec.entry_shape)
        assert storage.page_entries * spec.entry_bytes == arena.plan.stride[name]
        for p in range(pool.num_pages):  # every page lies inside its own frame
            start = _byte_offset(arena, storage.data[0, p])
            assert start == p * arena.plan.stride[name]
            assert storage.data[:, p].is_contiguous()
            assert start // fb == p // k
            assert start + spec.page_bytes(ps) <= (p // k + 1) * fb
        for p in held[name]:
            assert arena.owner[p // k] == pool.row
            start = _byte_offset(arena, storage.data[0, p])
            spans.append((start, start + spec.page_bytes(ps), name, p))
    spans.sort()
    for (_, end, *a), (start, _, *b) in itertools.pairwise(spans):
        assert end <= start, f"pages {a} and {b} overlap"

    def value(i: int) -> int:
        return 1 + i % 100  # exact in every dtype here

    # path 1: whole pages through data[:, page]
    order = [(n, p) for n in sorted(held) for p in held[n]]
    for i, (n, p) in enumerate(order):
        pools[n].storage.data[:, p] = value(i)  # type: ignore[union-attr]
    for i, (n, p) in enumerate(order):
        page = pools[n].storage.data[:, p]  # type: ignore[union-attr]
        assert bool((page == value(i)).all()), f"pool {n} page {p} was overwritten"
    # path 2: entry by entry through flat(layer)[page * page_entries + e]
    for i, (n, p) in enumerate(order):
        storage, spec = pools[n].storage, pools[n].spec
        assert storage is not None
        epp = spec.entries_per_page(ps)
        for layer in range(spec.layers):
            flat = storage.flat(layer)
            for e in range(epp):
                x = flat[p * storage.page_entries + e]
                assert x.data_ptr() == storage.data[layer, p, e].data_ptr()
                assert bool((x == value(i)).all())
                flat[p * storage.page_entries + e] = value(i + 7) + layer
    for i, (n, p) in enumerate(order):
        storage = pools[n].storage
        assert storage is not None
        for layer in range(pools[n].spec.layers):
            assert bool((storage.data[layer, p] == value(i + 7) + layer).all()), (
                f"pool {n} page {p} layer {layer}: flat and data disagree or alias")
    # derived addresses (PoolSpec.entry_index) reach the same entries
    for n, pool in pools.items():
        storage, spec = pool.storage, pool.spec
        if not held[n] or storage is None:
            continue
        table = np.asarray(held[n][:3], dtype=np.int64)
        positions = np.arange(len(table) * ps)
        if spec.ratio is None:
            positions = positions[ps - 1::ps]
        idx = spec.entry_index(table, positions, ps, storage.page_entries)
        for pos, j in zip(positions.tolist(), idx.tolist(), strict=True):
            page = int(table[pos // ps])
            e = 0 if spec.ratio is None else (pos % ps) // spec.ratio
            assert storage.flat(0)[j].data_ptr() == storage.data[0, page, e].data_ptr()


def test_prefix_cache_tensor_over_arena() -> None:
    """PrefixCache(arena=) with tensors: each pool's tensor is a view of the arena."""
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 6 * plan_frames(layout).frame_bytes, device="cpu")
    cache = PrefixCache(layout, {}, None, arena=arena)
    for name in layout.pool_names:
        t = cache.tensor(name)
        assert t.untyped_storage().data_ptr() == arena.data.untyped_storage().data_ptr()  # type: ignore[union-attr]
    got = cache.alloc({n: 2 for n in layout.pool_names})
    assert got is not None
    for row, name in enumerate(layout.pool_names):
        cache.tensor(name)[:, got[name]] = row + 1
    for row, name in enumerate(layout.pool_names):
        assert bool((cache.tensor(name)[:, got[name]] == row + 1).all())
    cache.free(got)
    cache.check_integrity(held={n: np.empty(0, PAGE_DTYPE) for n in layout.pool_names})
    assert arena.free_frames == arena.frames


# ---------------------------------------------------------------- manager
class ContentCache(PrefixCache):
    """A metadata-only PrefixCache whose compaction moves the pages' modelled content
    (pool row -> page -> key) with their ids."""

    content: list[dict[int, object]]

    def copy_pages(self, name: str, old: np.ndarray, new: np.ndarray) -> None:
        super().copy_pages(name, old, new)
        row = self.layout.index(name)
        for a, b in zip(old.tolist(), new.tolist(), strict=True):
            self.content[row][b] = self.content[row].get(a)  # a copy: the source keeps its bytes


class ArenaManagerMachine(ManagerMachine):
    """ManagerMachine with every device pool drawn from one arena of a few frames.

    A refusal over an arena may have evicted unlocked cache (PrefixCache.alloc), so it is
    checked only for what it may not do: take pages, drop locked ones, or break what the
    running requests read."""

    frames = 12
    host_pages = None

    def __init__(self) -> None:
        RuleBasedStateMachine.__init__(self)
        self.arena = Arena(self.layout, self.frames * plan_frames(self.layout).frame_bytes)
        self.content = [{} for _ in self.layout.pools]
        self.cache = ContentCache(self.layout, {}, self.policy, host_pages=self.host_pages,
                                  arena=self.arena)
        self.cache.content = self.content
        host = None
        if self.host_pages is not None:
            self.host_content = [{} for _ in self.layout.pools]
            mover = ContentMover([self.content, self.host_content], self.layout.pool_names)
            host = HostTier(self.cache, mover, self.write_policy)  # type: ignore[arg-type]
        self.manager = CacheManager(self.cache, host)
        self.running = []
        self.history = []
        self.steps = -1
        self.refused = 0

    def _device(self) -> tuple:
        pools = self.cache.tree.stats().as_dict()["pools"]
        return ([p.free_pages for p in self.cache.pools.values()],
                [pools[n]["pages"] for n in self.layout.pool_names],
                [pools[n]["locked"] for n in self.layout.pool_names])

    def _before_refusal(self) -> tuple:
        return self._device()

    def _after_refusal(self, before: tuple, what: str) -> None:  # type: ignore[override]
        """Over an arena a refusal may have evicted (PrefixCache.alloc): it may only give
        pages back, never take any or change a lock, and every running read still holds."""
        free, pages, locked = before
        free2, pages2, locked2 = self._device()
        assert all(b >= a for a, b in zip(free, free2, strict=True)), (
            f"a refused {what} took device pages: {free} -> {free2}")
        assert all(b <= a for a, b in zip(pages, pages2, strict=True)), (
            f"a refused {what} added tree pages: {pages} -> {pages2}")
        assert locked2 == locked, f"a refused {what} changed the locks: {locked} -> {locked2}"
        self.manager.check_integrity()
        for req in self.running:
            self._read(req, req.computed)
        self.refused += 1

    @invariant()
    def reads_hold(self) -> None:
        """What every running request reads is still its own tokens' data."""
        for req in self.running:
            self._read(req, req.computed)

    @invariant()
    def arena_books(self) -> None:
        arena = self.arena
        pools = self.cache._arena_pools
        assert sum(p.frames_held for p in pools.values()) + arena.free_frames == arena.frames
        stats = arena.stats(pools)
        assert stats["fragmented_bytes"] >= 0

    def teardown(self) -> None:
        super().teardown()
        assert self.arena.free_frames == self.arena.frames
        self.arena.check_integrity(self.cache._arena_pools)


class HostArenaManagerMachine(ArenaManagerMachine):
    host_pages = 12


class WriteBackArenaManagerMachine(HostArenaManagerMachine):
    write_policy = "write_back"


class SoloArenaManagerMachine(ArenaManagerMachine):
    """A request alone (nothing else running) that `fits_ever` the arena, admitted with
    `fit` and grown in the chunks `chunk_end` cuts, runs to completion."""

    def _frames_report(self) -> str:
        tree = self.cache.tree
        return f"{self.arena.free_frames} frames free of {self.arena.frames}; " + ", ".join(
            f"{n}: {p.used_pages} used ({tree.evictable(n)} evictable) in {p.frames_held} "
            f"frames of {p.per_frame}" for n, p in self.cache._arena_pools.items())

    @precondition(lambda self: not self.running)
    @rule(data=st.data(), chunk=st.integers(1, 12), n=st.integers(1, 10),
          how=st.sampled_from(["finish", "preempt"]))
    def solo(self, data: st.DataObject, chunk: int, n: int, how: str) -> None:
        tokens = self._tokens(data)
        self.history.append(tokens)
        if not self.manager.fits_ever(len(tokens)):
            return
        arr = np.asarray(tokens, dtype=np.int32)
        lease = self.manager.admit(arr, chunk, fit=True)
        assert lease is not None, (
            f"a lone request of {len(tokens)} that fits_ever was refused: "
            f"{self._frames_report()}")
        req = Running(tokens, lease, lease.cached)
        self._read(req, lease.cached, resume=True)
        self.running.append(req)
        while req.computed < len(tokens):
            end = self.manager.chunk_end(lease, req.computed, min(req.computed + n,
                                                                  len(tokens)))
            assert end > req.computed
            assert self.manager.grow(lease, end), (
                f"a lone request that fits_ever could not grow to {end} of {len(tokens)} "
                f"(cached {lease.cached}): {self._frames_report()}")
            self._write(req, req.computed, end)
            self._read(req, end)
            req.computed = end
            self.manager.cache_prefix(lease, tokens, end)
            self.manager.check_integrity()
        self.running.remove(req)
        if how == "finish":
            self.manager.finish(lease, tokens, req.computed)
        else:
            self.manager.preempt(lease, tokens, req.computed)


def _case(machine: type, runs: int) -> type:
    case = machine.TestCase
    case.settings = steps(runs)
    return case


TestArenaManager = _case(ArenaManagerMachine, 60)
TestHostArenaManager = _case(HostArenaManagerMachine, 30)
TestWriteBackArenaManager = _case(WriteBackArenaManagerMachine, 30)
TestSoloArenaManager = _case(SoloArenaManagerMachine, 40)



@pytest.mark.parametrize("pool", ["swa", "state"])
def test_an_arena_beside_a_short_lived_pool_in_host_memory_evicts(pool):
    """A window or state pool outside the arena (`in_host_memory`, as HiSparse keeps C4)
    counts 0 bytes in the shared-budget walk: once the arena was full, the walk divided by
    it (ZeroDivisionError out of admit) after letting pages go, so they leaked. Now such a
    row only goes along with a row that counts, and its own pool evicts it when short."""
    from shadowradix.tiers.manager import CacheManager
    from shadowradix.tree import CheckpointPolicy

    lay = tiny_layout(4)
    names = [n for n in lay.pool_names if n != pool]
    arena = Arena(lay, 40 * plan_frames(lay, names).frame_bytes, names=names)
    cache = PrefixCache(lay, {pool: 64}, CheckpointPolicy(), arena=arena,
                        in_host_memory=(pool,))
    manager = CacheManager(cache)
    for i in range(30):
        tokens = np.arange(i * 100, i * 100 + 13, dtype=np.int32)
        lease = manager.admit(tokens, 13)
        assert lease is not None
        manager.finish(lease, tokens, 13)
        manager.check_integrity()
    cache.flush()
    assert all(p.used_pages == 0 for p in cache.pools.values())


def test_the_fallback_frame_is_cut_as_finely_as_alignment_allows():
    """Entries of 4, 256 and 400 bytes: no frame from 512 to 1024 bytes cuts every pool, so
    the plan falls back to a frame every entry size divides (6400 bytes). It held one page
    of each pool: the 16-byte kv page used 0.25% of its frame, where 400 fit aligned."""
    lay = KVLayout("odd", (
        PoolSpec("kv", 1, Retention.ALL, (1,), "float32", 1),
        PoolSpec("c2", 2, Retention.ALL, (64,), "float32", 1),
        PoolSpec("swa", 1, Retention.WINDOW, (1,), "float32", 1, window=3),
        PoolSpec("state", None, Retention.CHECKPOINT, (100,), "float32", 1),
    ), 4)
    plan = plan_frames(lay)
    assert plan.frame_bytes == 6400 and plan.per_frame["kv"] == 400
    check_plan(lay, None)
