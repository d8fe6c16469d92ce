"""Attack on the ArenaPool book rewrite (a stack of free slots), PageOwners presized per
pool with absolute positions, and the host tier's copy tickets kept per arena frame.

    machine     ArenaPool against a brute-force model: alloc / free / claim / move /
                sparse over several pools sharing an arena (k == 1 pools among them),
                faults injected in Arena.take / Arena.give, bad ids of every kind
    ids         int64 ids past int32, duplicated ids, out-of-range ids
    owners      PageOwners over splits, relocations and their undo
    host        per-frame tickets: a copy in flight over a frame holds back every pool's
                next user of that frame
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_layout
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_arena import bad_free_ids

from shadowradix.layout import KVLayout, PoolSpec, Retention
from shadowradix.pool.allocator import PAGE_DTYPE, PoolExhausted
from shadowradix.pool.arena import FREE, Arena, plan_frames
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier

PS = 4


class Fault(Exception):
    """Injected into Arena.take / Arena.give."""


LAYOUTS = [
    tiny_layout(PS, window=5),  # kv 1, c2 3, swa 1, state 4 per frame
    tiny_layout(8, window=3),
    KVLayout("packed", (
        PoolSpec("a", 1, Retention.ALL, (1,), "uint8", 1, entry_bytes_override=5),
        PoolSpec("b", 4, Retention.ALL, (1,), "uint8", 2, entry_bytes_override=3),
        PoolSpec("s", None, Retention.CHECKPOINT, (1,), "uint8", 1, entry_bytes_override=7),
    ), 4),
]


def snapshot(arena: Arena, pools) -> tuple:
    """Everything the books hold, the order of both stacks included."""
    return (arena.owner.tobytes(), arena.free_frames, arena._free[:arena.free_frames].tobytes(),
            tuple((n, p.used_pages, p.frames_held, p._in_use.tobytes(),
                   p._slots[:p.slots_free].tobytes()) for n, p in sorted(pools.items())))


def loose_snapshot(arena: Arena, pools) -> tuple:
    """The books but for the order of the free slots."""
    return (arena.owner.tobytes(), arena.free_frames,
            sorted(arena._free[:arena.free_frames].tolist()),
            tuple((n, p.used_pages, p.frames_held, p._in_use.tobytes(),
                   sorted(p._slots[:p.slots_free].tolist())) for n, p in sorted(pools.items())))


class ArenaStackMachine(RuleBasedStateMachine):
    """Model: per pool the pages held and the free slot stack; per frame its owner."""

    @initialize(data=st.data())
    def make(self, data: st.DataObject) -> None:
        layout = data.draw(st.sampled_from(LAYOUTS))
        fb = plan_frames(layout).frame_bytes
        frames = data.draw(st.integers(1, 7))
        self.arena = Arena(layout, frames * fb)
        self.pools = self.arena.pools()
        self.names = sorted(self.pools)
        self.held: dict[str, set[int]] = {n: set() for n in self.names}
        self.owner: dict[int, str] = {}
        self.stack: dict[str, list[int]] = {n: [] for n in self.names}
        self.steps = 0

    # ------------------------------------------------------------- model
    def k(self, name: str) -> int:
        return self.pools[name].per_frame

    def frames_of(self, name: str) -> set[int]:
        return {f for f, n in self.owner.items() if n == name}

    def capacity(self, name: str) -> int:
        return len(self.stack[name]) + (self.arena.frames - len(self.owner)) * self.k(name)

    def free_in(self, name: str) -> dict[int, int]:
        k, out = self.k(name), {}
        for s in self.stack[name]:
            out[s // k] = out.get(s // k, 0) + 1
        return out

    def used_in(self, name: str, frame: int) -> int:
        k = self.k(name)
        return sum(1 for p in self.held[name] if p // k == frame)

    def model_free(self, name: str, pages: list[int]) -> None:
        k = self.k(name)
        self.held[name] -= set(pages)
        gone = set()
        for f in {p // k for p in pages}:
            if not any(p // k == f for p in self.held[name]):
                gone.add(f)
                del self.owner[f]
        self.stack[name] = [s for s in self.stack[name] if s // k not in gone] + [
            p for p in pages if p // k not in gone]

    def fault(self, monkeypatch_target: str):
        arena = self.arena
        real = getattr(arena, monkeypatch_target)

        def boom(*a, **kw):
            raise Fault(monkeypatch_target)

        setattr(arena, monkeypatch_target, boom)
        return lambda: setattr(arena, monkeypatch_target, real)

    # ------------------------------------------------------------- rules
    @rule(data=st.data(), faulty=st.booleans())
    def alloc(self, data: st.DataObject, faulty: bool) -> None:
        name = data.draw(st.sampled_from(self.names))
        pool, k = self.pools[name], self.k(name)
        cap = self.capacity(name)
        n = data.draw(st.one_of(st.integers(0, min(cap, 3 * k + 1)), st.integers(0, cap + 2)))
        before = snapshot(self.arena, self.pools)
        if n > cap:
            with pytest.raises(PoolExhausted):
                pool.alloc(n)
            assert snapshot(self.arena, self.pools) == before
            return
        stack = self.stack[name]
        if faulty and n > len(stack):
            undo = self.fault("take")
            try:
                with pytest.raises(Fault):
                    pool.alloc(n)
            finally:
                undo()
            assert snapshot(self.arena, self.pools) == before, "a take fault changed the books"
            return
        ids = pool.alloc(n).tolist()
        taken = min(n, len(stack))
        want = stack[len(stack) - taken:][::-1]
        del stack[len(stack) - taken:]
        fresh = list(dict.fromkeys(p // k for p in ids[taken:]))
        assert not set(fresh) & set(self.owner), "took a frame someone holds"
        assert len(fresh) == -(-(n - taken) // k)
        slots = [f * k + j for f in fresh for j in range(k)]
        want += slots[:n - taken]
        stack += slots[n - taken:][::-1]
        assert ids == want, (name, ids, want)
        self.held[name] |= set(ids)
        for f in fresh:
            self.owner[f] = name

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), faulty=st.booleans())
    def free(self, data: st.DataObject, faulty: bool) -> None:
        name = data.draw(st.sampled_from([n for n in self.names if self.held[n]]))
        pool, k = self.pools[name], self.k(name)
        pages = data.draw(st.lists(st.sampled_from(sorted(self.held[name])), unique=True,
                                   min_size=1))
        dtype = data.draw(st.sampled_from([np.int32, np.int64, np.intp]))
        empties = any(self.used_in(name, f) == sum(1 for p in pages if p // k == f)
                      for f in {p // k for p in pages})
        if faulty and empties:
            before = snapshot(self.arena, self.pools)
            undo = self.fault("give")
            try:
                with pytest.raises(Fault):
                    pool.free(np.asarray(pages, dtype=dtype))
            finally:
                undo()
            assert snapshot(self.arena, self.pools) == before, "a give fault changed the books"
            return
        self.model_free(name, pages)
        pool.free(np.asarray(pages, dtype=dtype))

    @rule(data=st.data(), how=st.sampled_from(["double", "range", "negative", "huge"]))
    def bad_free(self, data: st.DataObject, how: str) -> None:
        name = data.draw(st.sampled_from(self.names))
        pool = self.pools[name]
        pages = bad_free_ids(data, pool, self.held[name], how, most_negative=2**31)
        if pages is None:
            return
        before = snapshot(self.arena, self.pools)
        with pytest.raises(ValueError):
            pool.free(np.asarray(pages, dtype=np.int64))
        assert snapshot(self.arena, self.pools) == before, f"a refused free ({how}) changed"
        if how != "huge":
            with pytest.raises(ValueError):
                pool.claim(np.asarray(pages, dtype=np.int64))
            assert snapshot(self.arena, self.pools) == before, f"a refused claim ({how})"

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), faulty=st.booleans(), moving=st.booleans())
    def claim(self, data: st.DataObject, faulty: bool, moving: bool) -> None:
        name = data.draw(st.sampled_from([n for n in self.names if self.held[n]]))
        pool, k = self.pools[name], self.k(name)
        old = data.draw(st.lists(st.sampled_from(sorted(self.held[name])), unique=True))
        away = {p // k for p in old}
        room = self.free_in(name)
        cand = {f: c for f, c in room.items() if f not in away}
        before = snapshot(self.arena, self.pools)
        loose = loose_snapshot(self.arena, self.pools)
        if sum(cand.values()) < len(old):
            with pytest.raises(ValueError):
                (pool.move if moving else pool.claim)(np.asarray(old, dtype=PAGE_DTYPE))
            assert snapshot(self.arena, self.pools) == before
            return
        empties = bool(old) and any(self.used_in(name, f) == sum(1 for p in old if p // k == f)
                                    for f in away)
        if moving and faulty and empties:
            undo = self.fault("give")
            try:
                with pytest.raises(Fault):
                    pool.move(np.asarray(old, dtype=PAGE_DTYPE))
            finally:
                undo()
            # the order of the free slots is checked in its own test below
            assert loose_snapshot(self.arena, self.pools) == loose, "a failed move left a mark"
            # the model's stack: what the undo left
            self.stack[name] = pool._slots[:pool.slots_free].tolist()
            return
        new = (pool.move if moving else pool.claim)(np.asarray(old, dtype=PAGE_DTYPE)).tolist()
        assert len(new) == len(old) and len(set(new)) == len(new)
        stack = self.stack[name]
        assert set(new) <= set(stack), "claimed a slot not free"
        into = {p // k for p in new}
        assert not into & away, "claimed a slot in a frame being emptied"
        if new:  # fullest first: a frame with fewer free slots is used up before another
            worst = max(cand[f] for f in into)
            for f, c in cand.items():
                if f not in into:
                    assert c >= worst, (cand, into)
            for f in into:
                if cand[f] < worst:
                    assert all(s in new for s in stack if s // k == f), "a fuller frame left"
        self.stack[name] = [s for s in stack if s not in set(new)]
        self.held[name] |= set(new)
        if moving:
            self.model_free(name, old)

    @rule(data=st.data())
    def sparse(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names))
        pool, k = self.pools[name], self.k(name)
        limit = data.draw(st.integers(-1, 4))
        held_frames = sorted(self.frames_of(name))
        exclude = set(data.draw(st.lists(st.sampled_from(held_frames), unique=True))
                      ) if held_frames else set()
        if data.draw(st.booleans()):
            exclude |= {-3, self.arena.frames + 7}
        before = snapshot(self.arena, self.pools)
        got = pool.sparse(limit, exclude).tolist()
        assert snapshot(self.arena, self.pools) == before, "sparse changed the books"
        top = len(self.stack[name])
        room = self.free_in(name)
        cand = sorted((self.used_in(name, f), f) for f in room if f not in exclude)
        m = 0
        if k > 1 and limit >= 1 and top >= k:
            used = free = 0
            for u, _ in cand:
                if m == limit or used + u > top - free - (k - u):
                    break
                used += u
                free += k - u
                m += 1
        frames = {p // k for p in got}
        assert len(frames) == m, (name, got, cand, m, top, limit, exclude)
        assert not frames & exclude
        assert sorted(self.used_in(name, f) for f in frames) == [u for u, _ in cand[:m]]
        for f in frames:
            assert {p for p in self.held[name] if p // k == f} <= set(got)
        assert len(got) == len(set(got)) and set(got) <= self.held[name]
        if got and data.draw(st.booleans()):  # what sparse names moves and frees its frames
            new = pool.move(np.asarray(got, dtype=PAGE_DTYPE)).tolist()
            stack = self.stack[name]
            self.stack[name] = [s for s in stack if s not in set(new)]
            self.held[name] |= set(new)
            self.model_free(name, got)
            for f in frames:
                assert self.arena.owner[f] == FREE, "a frame sparse named stayed"

    @rule(data=st.data())
    def frames_short(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.names), unique=True))
        need = {n: data.draw(st.integers(0, self.capacity(n) + self.k(n))) for n in chosen}
        free_frames = self.arena.frames - len(self.owner)
        model = sum(-(-(m - len(self.stack[n])) // self.k(n)) for n, m in need.items()
                    if m > len(self.stack[n])) - free_frames
        assert self.arena.frames_short(self.pools, need) == model

    # -------------------------------------------------------- invariants
    @invariant()
    def books(self) -> None:
        if not hasattr(self, "arena"):
            return
        self.steps += 1
        arena = self.arena
        arena.check_integrity(self.pools)
        want = np.full(arena.frames, FREE)
        for f, n in self.owner.items():
            want[f] = self.pools[n].row
        assert np.array_equal(arena.owner, want)
        for n, pool in self.pools.items():
            assert pool.used_pages == len(self.held[n])
            assert pool.frames_held == len(self.frames_of(n))
            assert pool._slots[:pool.slots_free].tolist() == self.stack[n], "free slot stack"
            mask = np.zeros(pool.num_pages, dtype=bool)
            mask[list(self.held[n])] = True
            assert np.array_equal(pool._in_use, mask)
            assert pool.free_pages == self.capacity(n)


TestArenaStackMachine = ArenaStackMachine.TestCase
TestArenaStackMachine.settings = settings(max_examples=300, stateful_step_count=40,
                                          deadline=None, print_blob=True,
                                          suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ ids
def _c2_pool(frames: int = 4):
    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, frames * plan_frames(layout).frame_bytes)
    pools = arena.pools()
    return arena, pools, pools["c2"]  # 3 pages a frame


@pytest.mark.parametrize("op", ["free", "claim", "move"])
def test_an_int64_id_past_int32_is_refused_not_wrapped_to_a_page_in_use(op) -> None:
    """An int64 id of 2**32 + p is out of range; cast to int32 it wraps to p. free/claim
    must refuse it (ValueError, changing nothing), not act on page p."""
    arena, pools, c2 = _c2_pool()
    pages = c2.alloc(6)
    c2.free(pages[4:5])  # a free slot elsewhere, so claim/move could succeed
    before = snapshot(arena, pools)
    wrapped = np.array([2**32 + int(pages[0])], dtype=np.int64)
    with pytest.raises(ValueError):
        getattr(c2, op)(wrapped)
    assert snapshot(arena, pools) == before, f"{op} of id 2**32+{int(pages[0])} acted on it"


def test_duplicated_ids_in_one_free_are_caught_by_check_integrity() -> None:
    """As PagePool: a repeated id within one free is not refused, but the books then fail
    check_integrity (for a pool of several pages a frame, and for one of a page a frame)."""
    for name in ("c2", "kv"):
        arena, pools, _ = _c2_pool()
        pool = pools[name]
        pages = pool.alloc(2 * pool.per_frame)
        pool.free(np.array([pages[0], pages[0]]))
        with pytest.raises(AssertionError):
            arena.check_integrity(pools)


def test_a_failed_move_leaves_the_free_slot_stack_as_it_was() -> None:
    """move claims slots (taking them out of the stack), then frees the old pages; when the
    arena's give faults it frees the claimed slots again, but pushes them on top: the slot
    freed last is no longer taken first, so the books are not "as they were"."""
    arena, pools, c2 = _c2_pool()
    a = c2.alloc(9).tolist()  # frames of a[0:3], a[3:6], a[6:9], all full
    c2.free(np.array([a[0], a[3], a[4]]))
    c2.free(np.array([a[1]]))  # stack: a0 a3 a4 a1 (a1 on top)
    before = snapshot(arena, pools)
    real = arena.give

    def boom(*_: object) -> None:
        raise Fault("give")

    arena.give = boom  # type: ignore[method-assign]
    try:
        with pytest.raises(Fault):
            c2.move(np.array([a[2]]))  # its frame empties: give faults
    finally:
        arena.give = real  # type: ignore[method-assign]
    arena.check_integrity(pools)
    assert c2._slots[:c2.slots_free].tolist() == [a[0], a[3], a[4], a[1]]
    assert snapshot(arena, pools) == before
    assert c2.alloc(1).tolist() == [a[1]], "the slot freed last is not taken first"


# ------------------------------------------------------------ engine, host tier
@pytest.fixture(scope="module")
def model():
    from tiny_model import tiny_model

    return tiny_model()


@pytest.mark.parametrize("policy,frames,step,host", [
    ("write_back", 8, 16, 24), ("write_through", 9, 32, 40),
    ("write_through_selective", 12, 16, 16)])
def test_host_tier_over_a_tiny_arena_with_frames_changing_pools_stays_exact(
        model, monkeypatch, policy, frames, step, host) -> None:
    """Frames pass between pools while backups, spills and load-backs are in flight (each
    host copy slowed down, so many are): shared prefixes, resumes from the host, many
    requests at once; every logit is HF's and debug_poison would surface a page read
    before its copy landed."""
    import time

    from shadowradix.tiers import mover as mover_mod

    real_copy = mover_mod.copy_pages

    def slow_copy(*a, **kw):  # type: ignore[no-untyped-def]
        time.sleep(0.003)
        return real_copy(*a, **kw)

    monkeypatch.setattr(mover_mod, "copy_pages", slow_copy)
    from test_arena_attack import PS as EPS
    from test_arena_attack import arena_engine
    from test_engine import check, rand_tokens

    from shadowradix import SamplingParams

    eng = arena_engine(model, frames, step_tokens=step, host_tokens=host * EPS,
                       write_policy=policy)
    a, b = rand_tokens(40, 7100 + frames), rand_tokens(33, 7200 + frames)
    prompts = [a, b, a + rand_tokens(20, 7301), b + rand_tokens(7, 7302), a + b,
               rand_tokens(45, 7303), a + rand_tokens(3, 7304), b]
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for p in prompts[:4]:
        (r,) = eng.generate([p], params, return_logits=True)
        check(model, p, r, greedy=True)
        eng.check_integrity()
    for group in (prompts[2:6], prompts, prompts[::-1]):
        out = eng.generate(group, params, return_logits=True)
        for p, r in zip(group, out, strict=True):
            check(model, p, r, greedy=True)
        eng.check_integrity()


# ------------------------------------------------------------ compaction, splits
from test_compaction_attack import CompactionMachine, content_cache  # noqa: E402


class SplitCompactionMachine(CompactionMachine):
    """CompactionMachine over fewer frames (compaction and eviction every few steps) with
    forks: a new sequence off any page of a cached one, splitting its node there, so pages
    are renamed in nodes whose start_page moved since they were noted."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = content_cache(14, window=5, every=2)

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100), at=st.integers(1, 40), extra=st.integers(1, 3 * PS),
          seed=st.integers(0, 2**16))
    def fork(self, which: int, at: int, extra: int, seed: int) -> None:
        base = self.seqs[which % len(self.seqs)]
        cut = min(at, max(base.size // PS - 1, 1)) * PS
        rng = np.random.default_rng(seed)
        self._serve(np.concatenate([base[:cut], 6 + rng.integers(0, 6, extra)]).astype(np.int32))

    @precondition(lambda self: self.seqs)
    @rule(which=st.integers(0, 100), at=st.integers(1, 40))
    def lock_mid(self, which: int, at: int) -> None:
        """A lock ending inside a node (a match splits it there)."""
        tokens = self.seqs[which % len(self.seqs)]
        self.lock(which, max(tokens.size - at * PS, 0) if tokens.size > PS else 0)


TestSplitCompactionMachine = SplitCompactionMachine.TestCase
TestSplitCompactionMachine.settings = settings(max_examples=120, stateful_step_count=60,
                                               deadline=None, print_blob=True,
                                               suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------ host tier, in flight
class DeferredMover:
    """Copies queue up and land only when `land` (or `wait`) says: tickets in order."""

    def __init__(self) -> None:
        self.last = 0
        self.landed = 0
        self.queued: dict[int, list] = {}  # ticket -> copies (name, tier, src, dst)

    def submit(self, copies) -> int:  # type: ignore[no-untyped-def]
        self.last += 1
        self.queued[self.last] = [(n, t, np.asarray(s).copy(), np.asarray(d).copy())
                                  for n, t, s, d in copies]
        return self.last

    def run(self, fn) -> int:  # type: ignore[no-untyped-def]
        self.wait(self.last)
        fn()
        self.last += 1
        self.landed = self.last
        return self.last

    def land(self, upto: int) -> None:
        for t in sorted(self.queued):
            if t <= upto:
                del self.queued[t]
        self.landed = max(self.landed, upto)

    def done(self, ticket: int) -> bool:
        return ticket <= self.landed

    def wait(self, ticket: int) -> None:
        self.land(ticket)

    def failures(self, ticket: int) -> list:
        return []

    @property
    def idle(self) -> bool:
        return self.done(self.last)

    def close(self) -> None:
        self.land(self.last)


def _device_bytes(arena: Arena, name: str, pages: np.ndarray) -> set[tuple[int, int]]:
    """(start, end) byte ranges of device pages of pool `name` in the arena."""
    plan, layout = arena.plan, arena.layout
    k, stride = plan.per_frame[name], plan.stride[name]
    size = layout.pool(name).page_bytes(layout.page_size)
    out = set()
    for p in np.asarray(pages).ravel().tolist():
        if p >= 0:
            start = (p // k) * plan.frame_bytes + (p % k) * stride
            out.add((start, start + size))
    return out


def _overlap(a: set[tuple[int, int]], b: set[tuple[int, int]]) -> bool:
    return any(s < e2 and s2 < e for s, e in a for s2, e2 in b)


def _tickets_cover_every_copy_in_flight(arena: Arena, mover: DeferredMover, names, leases
                                        ) -> None:
    """No copy still queued past a lease's ready ticket writes bytes the lease reads, or
    reads or writes bytes the lease writes (its own pages)."""
    from shadowradix.tree.tier import DEVICE

    for lease in leases:
        reads = set().union(*(_device_bytes(arena, n, lease.table[row])
                              for row, n in enumerate(names)))
        writes = set().union(*(_device_bytes(arena, n, lease.table[row][lease.own[row]])
                               for row, n in enumerate(names)))
        for ticket, copies in mover.queued.items():
            if ticket <= lease.ready:
                continue
            for name, tier, src, dst in copies:
                if tier == DEVICE:  # device -> host: reads src on the device
                    hit = _overlap(_device_bytes(arena, name, src), writes)
                    what = "reads the bytes of a page the request writes"
                else:  # host -> device: writes dst
                    hit = _overlap(_device_bytes(arena, name, dst), reads | writes)
                    what = "writes the bytes of a page the request touches"
                assert not hit, (f"copy {ticket} ({name}) still in flight {what}; the "
                                 f"request waits only for {lease.ready}")


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
@pytest.mark.parametrize("seed", range(6))
def test_a_requests_ready_ticket_covers_every_copy_in_flight_over_its_bytes(policy, seed
                                                                            ) -> None:
    """A manager workload over a tiny arena with a host tier whose copies land only now and
    then: whatever pool a frame serves now, a request's ready ticket covers every queued
    copy over the bytes it touches."""
    from test_arena_compaction import next_turn

    from shadowradix.tiers.manager import CacheManager

    layout = tiny_layout(PS, window=5)
    arena = Arena(layout, 10 * plan_frames(layout).frame_bytes)
    cache = PrefixCache(layout, {}, None, host_pages=14, arena=arena)
    mover = DeferredMover()
    host = HostTier(cache, mover, policy)  # type: ignore[arg-type]
    manager = CacheManager(cache, host)
    names = layout.pool_names
    rng = np.random.default_rng(seed)
    chats: list[np.ndarray] = []
    held: list[tuple[object, np.ndarray]] = []
    checked = 0
    for _ in range(150):
        if rng.random() < 0.4:
            mover.land(int(rng.integers(mover.landed, mover.last + 1)))
        if held and (len(held) >= 3 or rng.random() < 0.35):
            lease, toks = held.pop(int(rng.integers(len(held))))
            mover.wait(lease.ready)  # it ran
            manager.finish(lease, toks, toks.size)
        _, tokens = next_turn(rng, chats, 0.6)
        lease = manager.admit(tokens, PS)
        if lease is None:
            continue
        ok = True
        for end in range(2 * PS, tokens.size + PS, PS):
            _tickets_cover_every_copy_in_flight(arena, mover, names, [lease])
            checked += 1
            mover.wait(lease.ready)  # the forward of this chunk runs
            if not manager.grow(lease, min(end, tokens.size)):
                manager.abort(lease)
                ok = False
                break
        if not ok:
            continue
        _tickets_cover_every_copy_in_flight(arena, mover, names, [lease])
        if rng.random() < 0.5:
            held.append((lease, tokens))
        else:
            mover.wait(lease.ready)
            manager.finish(lease, tokens, tokens.size)
        _tickets_cover_every_copy_in_flight(arena, mover, names, [le for le, _ in held])
        manager.check_integrity()
    assert checked > 50


def test_a_fault_in_a_compactions_copy_leaves_the_free_slot_stack_as_it_was(monkeypatch
                                                                             ) -> None:
    """PrefixCache compaction claims slots, renames, copies; a fault in the copy undoes the
    rename and frees the claimed slots, which go back on top of the stack: afterwards the
    pool hands out the claimed slots first, not the slot freed last before the fault."""
    from test_compaction_attack import frames_of

    cache, _ = frames_of([1, 3, 2])
    c4 = cache.pools["c4"]
    before = c4._slots[:c4.slots_free].tolist()

    def boom(*_: object) -> None:
        raise Fault("copy")

    monkeypatch.setattr(PrefixCache, "copy_pages", boom)
    with pytest.raises(Fault):
        cache.compact(1)
    monkeypatch.undo()
    cache.check_integrity()
    assert c4._slots[:c4.slots_free].tolist() == before, "the free slots changed order"
