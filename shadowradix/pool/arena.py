"""One device byte budget for every pool: an arena of equal frames, each cut into pages of
the one pool that holds it (a slab).

    frame   frame_bytes of the arena, free or held by one pool
    slab    a held frame cut into `per_frame[pool]` pages of that pool, each `stride[pool]`
            bytes apart (at least the pool's page bytes); page id = frame * per_frame + slot

A pool takes a frame when its slabs are full and gives it back when its last page there is
freed, so the window pool grows and shrinks against the others with what the workload uses,
however different their page sizes. The frame is the largest page, grown where needed so
that every pool's slab is a whole number of aligned entries (`plan_frames`): a page's
address stays linear in its id (`id * stride`), so a pool over the arena is an ordinary
strided `[layers, pages, entries, *entry]` tensor and every reader of pool tensors works
unchanged.

What it costs, both counted by `Arena.stats`:
    slack   the bytes of a frame past its last slot (frame_bytes - per_frame * page bytes):
            fixed by the plan, a few percent at most for DeepSeek-V4's pools.
    holes   free slots in frames a pool still holds: a frame goes back only once every
            page in it is free. Allocation takes the slot freed last first (a stack, as
            PagePool's free list), so pages allocated together share frames and drain
            together (on the conversation trace this beats fullest-first). Before
            evicting for a frame, the cache compacts (`PrefixCache.compact`): `sparse`
            names the pages of a pool's emptiest frames that fit in the free slots of its
            others, and `move` gives them slots there, so those frames go back; the
            tree's pages (and only those no lock holds) are renamed and their bytes
            copied (`claim` books the new slots first, so a fault in the copy undoes the
            move). What remains is held by running requests.

The simulator's metadata-only pools use this same code (no tensor), so a replay counts the
fragmentation the engine would have.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shadowradix.layout.spec import KVLayout, PoolSpec
from shadowradix.pool.allocator import PAGE_DTYPE, PoolExhausted, checked_free, page_count

if TYPE_CHECKING:
    from shadowradix.pool.storage import PoolStorage

FREE = -1  # owner of a free frame
_NONE = np.empty(0, dtype=np.int64)  # no frame (read only)
_NONE.flags.writeable = False
_NO_CLAIM = (np.empty(0, PAGE_DTYPE), np.empty(0, PAGE_DTYPE))  # no claim to undo
MAX_GROWTH = 2.0  # the frame search looks up to this many times the largest page


@dataclass(frozen=True)
class FramePlan:
    """How an arena's frames are cut: frame_bytes, and per pool the pages a frame holds
    and the bytes between their starts."""

    frame_bytes: int
    per_frame: dict[str, int]
    stride: dict[str, int]

    def frames(self, pages: Mapping[str, int], spread: Collection[str] = ()) -> int:
        """The frames `pages` (per pool) take: a frame each for a pool in `spread`, packed
        for the others; pools the plan does not cut take none."""
        return sum(n if name in spread else -(-n // self.per_frame[name])
                   for name, n in pages.items() if name in self.per_frame)

    def slack(self, pool: str, page_bytes: int) -> float:
        """Share of a frame of `pool` no page of it covers."""
        return 1 - self.per_frame[pool] * page_bytes / self.frame_bytes


def plan_frames(layout: KVLayout, names: Collection[str] | None = None) -> FramePlan:
    """The frame for `layout`'s pools (`names`; None: all): the smallest, from the largest
    page up, whose mean slack is least (or under 1%), where every pool's slab is a whole
    number of pages a whole number of entries apart (so a page's entries stay aligned in
    its dtype). Packed (metadata-only) entries need no alignment: the frame is then the
    largest page."""
    ps = layout.page_size
    specs = [p for p in layout.pools if names is None or p.name in names]
    if not specs:
        raise ValueError("an arena needs at least one pool")
    sizes = {p.name: (p.page_bytes(ps), p.entry_bytes) for p in specs}
    largest = max(b for b, _ in sizes.values())
    if any(p.entry_bytes_override is not None for p in specs):
        return FramePlan(largest, {n: largest // b for n, (b, _) in sizes.items()},
                         {n: b for n, (b, _) in sizes.items()})
    step = sizes[max(sizes, key=lambda n: sizes[n][0])][1]
    best: tuple[float, int, dict[str, int]] | None = None
    frame = -(-largest // step) * step
    while frame <= MAX_GROWTH * largest:
        cut = {n: _per_frame(frame, b, e) for n, (b, e) in sizes.items()}
        if all(cut.values()):
            waste = sum(frame - cut[n] * b for n, (b, _) in sizes.items()) / (
                len(sizes) * frame)
            if best is None or waste < best[0] - 1e-12:
                best = (waste, frame, cut)
                if waste < 0.01:
                    break
        frame += step
    if best is None:  # no aligned cut within reach: a frame every entry size divides,
        frame = int(np.lcm.reduce([e for _, e in sizes.values()]))  # cut as finely as it goes
        frame *= -(-largest // frame)
        best = (0.0, frame, {n: _per_frame(frame, b, e) for n, (b, e) in sizes.items()})
    _, frame, cut = best
    return FramePlan(frame, cut, {n: frame // k for n, k in cut.items()})


def arena_bytes(layout: KVLayout, pages: Mapping[str, int],
                names: Collection[str] | None = None, reserved_bytes: int = 0,
                request: Mapping[str, int] | None = None, spread: Collection[str] = ()) -> int:
    """The bytes of an arena over `layout`'s pools `names` (None: all) in place of fixed
    pools of `pages` each, beside `reserved_bytes` (set apart in whole frames, so the pools
    may get up to a frame less): the fixed pools' and the reserved bytes in whole frames,
    or, where that is more, the frames the longest request the fixed pools held takes
    alone (`request`, its peak pages per pool; None: `pages`), so that it fits the arena
    too: packed, but a frame each for its pages of a pool in `spread` (its window and
    resume state, which come and go beside the tree's copies: PrefixCache.fits_arena).
    The second is more only where the frames' slack (their bytes past their last page)
    outweighs the window pages such a request lets go: pools of a few pages, or a policy
    without tombstones (no `spread`: the request holds every page of every pool).
    `CacheConfig.device_tokens` is this shorthand for a byte budget."""
    plan = plan_frames(layout, names)
    fb = plan.frame_bytes
    fixed = sum(pages[n] * layout.pool(n).page_bytes(layout.page_size) for n in plan.per_frame)
    alone = plan.frames(pages if request is None else request, spread)
    reserved = -(-reserved_bytes // fb) if reserved_bytes > 0 else 0
    return max(-(-(fixed + max(reserved_bytes, 0)) // fb), alone + reserved) * fb


def _per_frame(frame: int, page_bytes: int, entry_bytes: int) -> int:
    """The most pages of `page_bytes` a frame holds at one stride that divides it and is a
    multiple of `entry_bytes`; 0 if none."""
    k = frame // page_bytes
    while k and (frame % k or (frame // k) % entry_bytes):
        k -= 1
    return k


class Arena:
    """Frames of `plan.frame_bytes` in `total_bytes` (less `reserved_bytes`, set apart for
    something else: HiSparse's hot buffers), shared by the pools `names` of one layout
    (None: all). With `device`, one uint8 tensor holds them and every pool views it
    (`ArenaPool.storage`)."""

    def __init__(self, layout: KVLayout, total_bytes: int, device: Any = None,
                 names: Collection[str] | None = None, reserved_bytes: int = 0) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes < 0:
            raise ValueError(f"arena bytes must be an int >= 0, got {total_bytes!r}")
        if isinstance(reserved_bytes, bool) or not isinstance(reserved_bytes, int | np.integer) \
                or reserved_bytes < 0:
            raise ValueError(f"reserved bytes must be an int >= 0, got {reserved_bytes!r}")
        self.layout = layout
        self.names = tuple(p.name for p in layout.pools if names is None or p.name in names)
        self.plan = plan_frames(layout, self.names)
        fb = self.plan.frame_bytes
        self.reserved_frames = -(-reserved_bytes // fb) if reserved_bytes > 0 else 0
        self.frames = total_bytes // fb - self.reserved_frames
        if self.frames < 1:
            raise ValueError(f"an arena of {total_bytes} bytes holds no frame of {fb} bytes "
                             f"(the largest page, aligned)" + (
                                 f" besides the {self.reserved_frames} frames "
                                 f"({self.reserved_frames * fb} bytes) set apart"
                                 if self.reserved_frames else ""))
        for name, k in self.plan.per_frame.items():  # before any array is made
            if self.frames * k >= np.iinfo(PAGE_DTYPE).max:
                raise ValueError(f"pool {name!r}: {self.frames * k} pages exceed int32 page "
                                 f"ids (an arena of {total_bytes} bytes)")
        self.total_bytes = total_bytes
        self.owner = np.full(self.frames, FREE, dtype=np.int8)  # pool row, or FREE
        self._free = np.arange(self.frames - 1, -1, -1, dtype=PAGE_DTYPE)
        self._top = self.frames
        self.data = None
        if device is not None:
            import torch

            self.data = torch.zeros(self.frames * fb, dtype=torch.uint8, device=device)

    @property
    def free_frames(self) -> int:
        return self._top

    def take(self, n: int, row: int) -> np.ndarray:
        """`n` free frames for pool row `row`. A fault (an interrupt too) changes nothing."""
        top = self._top
        if n > top:
            raise PoolExhausted(f"arena: asked for {n} frames, {top} free")
        frames = self._free[top - n:top][::-1].copy()
        try:
            self.owner[frames] = row
            self._top = top - n
            return frames
        except BaseException:
            self.untake(frames, top)
            raise

    def untake(self, frames: np.ndarray, top: int) -> None:
        """Undo a `take` of `frames` when the free list's top was `top` (nothing taken or
        given since)."""
        self.owner[frames] = FREE
        self._top = top

    def give(self, frames: np.ndarray) -> None:
        """Frames back to the free list. A fault (an interrupt too) changes nothing."""
        top, row = self._top, int(self.owner[frames[0]]) if frames.size else FREE
        try:
            self.owner[frames] = FREE
            self._free[top:top + frames.size] = frames
            self._top = top + frames.size
        except BaseException:
            self.ungive(frames, top, row)
            raise

    def ungive(self, frames: np.ndarray, top: int, row: int) -> None:
        """Undo a `give` of pool row `row`'s `frames` when the free list's top was `top`."""
        self.owner[frames] = row
        self._top = top

    def info(self) -> dict[str, Any]:
        """Its shape: frame bytes, frames, the bytes set apart, pages of each pool a frame."""
        fb = self.plan.frame_bytes
        return {"frame_bytes": fb, "frames": self.frames,
                "reserved_bytes": self.reserved_frames * fb,
                "pages_per_frame": dict(self.plan.per_frame)}

    def pools(self) -> dict[str, ArenaPool]:
        """One pool per layout pool, drawing frames from this arena."""
        return {spec.name: ArenaPool(self, row, spec)
                for row, spec in enumerate(self.layout.pools) if spec.name in self.names}

    def frames_short(self, pools: Mapping[str, ArenaPool], need: Mapping[str, int]) -> int:
        """Frames `need` takes beyond the pools' free slots, less the free frames (<= 0:
        it fits now). Pools not in `pools` (not in the arena) take none."""
        frames = 0
        for name, n in need.items():
            pool = pools.get(name)
            if pool is None:
                continue
            extra = n - pool.slots_free
            if extra > 0:
                frames += -(-extra // pool.per_frame)
        return frames - self._top

    def stats(self, pools: Mapping[str, ArenaPool]) -> dict[str, Any]:
        """Bytes per pool (frames held), what their pages use, and fragmentation."""
        fb, ps = self.plan.frame_bytes, self.layout.page_size
        out: dict[str, Any] = {"frame_bytes": fb, "frames": self.frames,
                               "free_frames": self._top, "bytes": self.frames * fb,
                               "reserved_bytes": self.reserved_frames * fb, "pools": {}}
        held = used = 0
        for name, pool in pools.items():
            page = pool.spec.page_bytes(ps)
            frames = pool.frames_held
            held += frames * fb
            used += pool.used_pages * page
            out["pools"][name] = {"frames": frames, "bytes": frames * fb,
                                  "used_bytes": pool.used_pages * page,
                                  "free_slots": pool.slots_free, "per_frame": pool.per_frame}
        out["used_bytes"] = used
        out["fragmented_bytes"] = held - used  # slack plus holes in held frames
        return out

    def check_integrity(self, pools: Mapping[str, ArenaPool]) -> None:
        free = self._free[:self._top]
        if np.unique(free).size != free.size or (self.owner[free] != FREE).any():
            raise AssertionError("arena: the free frame list is inconsistent")
        if int((self.owner == FREE).sum()) != self._top:
            raise AssertionError("arena: free frames are not all on the free list")
        for pool in pools.values():
            pool.check_integrity()


class ArenaPool:
    """A pool's pages over an Arena: the PagePool interface (alloc, free, can_alloc,
    in_use, free_pages, used_pages, num_pages, check_integrity), page ids up to
    frames * per_frame. `free_pages` counts what it could take with nothing else
    allocating (its free slots plus every free frame): pools share the free frames, so
    `Arena.frames_short` is what answers whether several pools' needs fit together.

    Its books are PagePool's: the in-use mask and a stack of free slots, here the free
    slots of the frames it holds (the slot freed last is taken first, so pages of one age
    share frames and drain together). A frame's slots leave the stack when it goes back."""

    def __init__(self, arena: Arena, row: int, spec: PoolSpec) -> None:
        self.arena = arena
        self.row = row
        self.spec = spec
        self.page_size = arena.layout.page_size
        self.per_frame = arena.plan.per_frame[spec.name]
        self.num_pages = arena.frames * self.per_frame
        if self.num_pages >= np.iinfo(PAGE_DTYPE).max:
            raise ValueError(f"pool {spec.name!r}: {self.num_pages} pages exceed int32 ids")
        self._in_use = np.zeros(self.num_pages, dtype=bool)
        self._slots = np.empty(self.num_pages, dtype=PAGE_DTYPE)  # free slots, top last
        self._top = 0
        self._gone = np.zeros(arena.frames, dtype=bool)  # scratch: frames going back
        self._offsets = np.arange(self.per_frame, dtype=PAGE_DTYPE)  # a frame's slots
        self._claimed = _NO_CLAIM  # the last claim's slots and the stack before it (`unclaim`)
        self.used_pages = 0
        self.frames_held = 0
        self.storage: PoolStorage | None = None
        if arena.data is not None:
            from shadowradix.pool.storage import PoolStorage

            self.storage = PoolStorage.over(arena.data, spec, self.page_size, self.num_pages,
                                            arena.plan.stride[spec.name])

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def slots_free(self) -> int:
        """Free pages in frames this pool holds."""
        return self._top

    @property
    def free_pages(self) -> int:
        return self._top + self.arena.free_frames * self.per_frame

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self.free_pages

    def alloc(self, n: int) -> np.ndarray:
        """Take `n` pages: free slots of the frames it holds first (the one freed last
        first), then new frames. Raises PoolExhausted (changing nothing) if they do not
        fit; any other fault, an interrupt too, changes nothing either."""
        if type(n) is not int or n < 0:
            n = page_count(self.name, n)
        k, top = self.per_frame, self._top
        if n > top + self.arena._top * k:
            raise PoolExhausted(f"pool {self.name!r}: asked for {n} pages, "
                                f"{self.free_pages} free in the arena")
        if n == 0:
            return np.empty(0, PAGE_DTYPE)
        books, arena_top = self._books(), self.arena._top
        fresh = pages = None
        try:
            if n <= top:
                pages = self._slots[top - n:top][::-1].copy()
                self._top = top - n
            else:  # new frames
                fresh = self.arena.take(-(-(n - top) // k), self.row)
                if k == 1:  # a page is a frame: no free slots ever
                    pages = fresh
                else:
                    slots = (fresh[:, None] * k + self._offsets).ravel()
                    pages = np.concatenate((self._slots[:top][::-1], slots[:n - top]))
                    rest = slots[n - top:]  # the last new frame's slots it leaves free
                    self._slots[:rest.size] = rest[::-1]
                    self._top = rest.size
                self.frames_held = books[2] + fresh.size
            self._in_use[pages] = True
            self.used_pages = books[1] + n
            return pages
        except BaseException:  # as it was: the stack's slots it took, and the frames
            if pages is not None:
                self._in_use[pages] = False
                if fresh is not None and k > 1:
                    self._slots[:top] = pages[:top][::-1]
            self._restore(books)
            if fresh is not None:
                self.arena.untake(fresh, arena_top)
            raise

    def free(self, pages: np.ndarray) -> None:
        """Return pages; a frame whose last page goes back returns to the arena. Raises
        ValueError (changing nothing) on a page not in use; any other fault, an interrupt
        too, changes nothing either."""
        pages = checked_free(self.name, self._in_use, pages)
        n = pages.size
        if n == 0:
            return
        books, arena_top, k = self._books(), self.arena._top, self.per_frame
        stack = gone = None
        try:
            if k == 1:  # a page is a frame
                gone = pages
                self.arena.give(pages.copy())
                self._in_use[pages] = False
            else:
                self._in_use[pages] = False
                gone = self._emptied(pages)
                if gone.size:  # those frames go back; their slots leave the stack
                    stack = self._slots[:books[0]].copy()
                    self.arena.give(gone)
                    self._drop_slots(gone, pages)
                else:
                    self._push(pages)
            self.frames_held = books[2] - gone.size
            self.used_pages = books[1] - n
        except BaseException:  # as it was
            self._in_use[pages] = True
            self._restore(books, stack)
            if gone is not None and gone.size:
                self.arena.ungive(gone, arena_top, self.row)
            raise

    def _emptied(self, pages: np.ndarray) -> np.ndarray:
        """The frames `pages` (just marked free) left with no page in use."""
        k, in_use = self.per_frame, self._in_use
        n = pages.size
        if self._top + n < k:  # fewer free slots than a frame: none emptied
            return _NONE
        if n == 1:  # the commonest: one frame to look at
            frame = pages.item(0) // k
            if np.count_nonzero(in_use[frame * k:frame * k + k]):
                return _NONE
            return np.array([frame])
        frames = pages // k
        first = np.empty(n, dtype=bool)  # runs of one frame cut to one (a node's pages
        first[0] = True                  # come in runs)
        np.not_equal(frames[1:], frames[:-1], out=first[1:])
        touched = frames[first]
        left = in_use.reshape(-1, k)[touched].any(axis=1)  # pages in use left in each
        if np.count_nonzero(left) == left.size:
            return _NONE
        return np.unique(touched[~left])

    def _drop_slots(self, gone: np.ndarray, pages: np.ndarray) -> None:
        """The stack without the slots of frames `gone` (going back to the arena), then
        `pages` but theirs on top."""
        k, mark = self.per_frame, self._gone
        mark[gone] = True
        try:
            slots = self._slots[:self._top]
            kept = slots[~mark[slots // k]]
            rest = pages[~mark[pages // k]]
        finally:
            mark[gone] = False
        self._top = 0
        self._push(kept)
        self._push(rest)

    def _push(self, slots: np.ndarray) -> None:
        top = self._top
        self._slots[top:top + slots.size] = slots
        self._top = top + slots.size

    def _books(self) -> tuple[int, int, int]:
        """The counts a change cut short restores (see `_restore`)."""
        return self._top, self.used_pages, self.frames_held

    def _restore(self, books: tuple[int, int, int], stack: np.ndarray | None = None) -> None:
        """Undo a change a fault cut short: the counts `books` and, given, the stack's
        slots (`stack`, the first of them)."""
        if stack is not None:
            self._slots[:stack.size] = stack
        self._top, self.used_pages, self.frames_held = books

    def _free_per_frame(self, exclude: Collection[int] = (),
                        only: Collection[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The held frames with a free slot (but `exclude`; of `only`, when given) and how
        many each has free."""
        free = np.bincount(self._slots[:self._top] // self.per_frame,
                           minlength=self.arena.frames)
        if only is not None:
            keep = np.zeros(free.size, dtype=bool)
            ids = np.fromiter(only, np.int64, len(only))
            keep[ids[(ids >= 0) & (ids < free.size)]] = True
            free[~keep] = 0
        if exclude:
            out = np.fromiter(exclude, np.int64, len(exclude))
            free[out[(out >= 0) & (out < free.size)]] = 0
        frames = np.flatnonzero(free)
        return frames, free[frames]

    def sparse(self, limit: int, exclude: Collection[int] = (),
               avoid: Collection[int] = ()) -> np.ndarray:
        """The pages in use in up to `limit` of the emptiest frames this pool holds, but
        `exclude` and `avoid`, whose pages fit in the free slots of its other frames
        (`exclude`d ones too, not those in `avoid`: frames a copy in flight may still read
        or write): what compaction moves so those frames go back to the arena (none while
        its free slots make no whole frame)."""
        k = self.per_frame
        if k == 1 or limit < 1 or self._top < k:
            return np.empty(0, PAGE_DTYPE)
        slots = self._top  # the free slots a move may take
        if avoid:
            slots -= int(self._free_per_frame(only=avoid)[1].sum())
        frames, free = self._free_per_frame((*exclude, *avoid) if avoid else exclude)
        order = np.argsort(-free, kind="stable")  # emptiest first
        frames, used = frames[order], k - free[order]
        room = slots - np.cumsum(free[order])  # free slots past the m emptiest
        m = min(limit, int(np.count_nonzero(np.cumsum(used) <= room)))
        which, slot = np.nonzero(self._in_use.reshape(-1, k)[frames[:m]])
        return (frames[:m][which] * k + slot).astype(PAGE_DTYPE)

    def claim(self, old: np.ndarray, avoid: Collection[int] = ()) -> np.ndarray:
        """Book a free slot for each page in use of `old`, in the frames that hold none of
        them and are not in `avoid` (the fullest first): their new ids, in order. `old`
        stays in use: the caller frees it once the bytes and the ids moved (`move` does
        both). ValueError (changing nothing) if they do not fit."""
        old = checked_free(self.name, self._in_use, old)
        k = self.per_frame
        if old.size == 0:
            return old.copy()
        slots = self._slots[:self._top]
        frames, free = self._free_per_frame([*(old // k).tolist(), *avoid])
        rank = np.full(self.arena.frames, -1, dtype=np.int64)  # fullest frame first
        rank[frames[np.argsort(free, kind="stable")]] = np.arange(frames.size)
        at = rank[slots // k]
        fits = np.flatnonzero(at >= 0)
        if fits.size < old.size:
            raise ValueError(f"pool {self.name!r}: {old.size} pages to move, "
                             f"{fits.size} free slots elsewhere")
        take = fits[np.argsort(at[fits], kind="stable")[:old.size]]
        new = slots[take].copy()
        stack, books = slots.copy(), self._books()
        left = np.ones(slots.size, dtype=bool)
        left[take] = False
        rest = slots[left]
        try:  # a fault (an interrupt too) changes nothing
            self._claimed = (new, stack)  # for `unclaim`
            self._slots[:rest.size] = rest
            self._top = rest.size
            self._in_use[new] = True
            self.used_pages = books[1] + new.size
            return new
        except BaseException:
            self._in_use[new] = False
            self._restore(books, stack)
            self._claimed = _NO_CLAIM
            raise

    def unclaim(self, new: np.ndarray) -> None:
        """Undo the last `claim` (it returned `new`; nothing allocated or freed since): its
        slots go back where they were in the stack, so the next allocations take what they
        would have. ValueError (changing nothing) for anything else."""
        claimed, stack = self._claimed
        new = np.asarray(new)
        if (new.shape != claimed.shape or not np.array_equal(new, claimed)
                or not self._in_use[claimed].all()
                or stack.size != self._top + claimed.size):
            raise ValueError(f"pool {self.name!r}: unclaim of what the last claim did not "
                             f"return, or after other changes")
        books, now = self._books(), self._slots[:self._top].copy()
        try:  # a fault (an interrupt too) changes nothing
            self._in_use[claimed] = False
            self._slots[:stack.size] = stack
            self._top = stack.size
            self.used_pages = books[1] - claimed.size
            self._claimed = _NO_CLAIM
        except BaseException:
            self._in_use[claimed] = True
            self._restore(books, now)
            self._claimed = (claimed, stack)
            raise

    def move(self, old: np.ndarray) -> np.ndarray:
        """`claim` slots for pages in use `old` and free `old`: their new ids, in order.
        Frames left empty go back to the arena. A fault (an interrupt too) changes
        nothing: `old` keeps its slots."""
        new = stack = None
        try:
            new = self.claim(old)
            ids = np.asarray(old, dtype=PAGE_DTYPE).ravel()  # checked by the claim
            books, stack, arena_top = (self._books(), self._slots[:self._top].copy(),
                                       self.arena._top)
            self.free(ids)
            return new
        except BaseException:
            if stack is not None and ids.size and not self._in_use[ids[0]]:
                gone = np.unique(ids // self.per_frame)  # the free went through: undone
                gone = gone[self.arena.owner[gone] == FREE]
                self._in_use[ids] = True
                self._restore(books, stack)
                self.arena.ungive(gone, arena_top, self.row)
            if new is not None:
                self.unclaim(new)
            raise

    def in_use(self, pages: np.ndarray) -> np.ndarray:
        return self._in_use[np.asarray(pages, dtype=PAGE_DTYPE)]

    def check_integrity(self) -> None:
        k = self.per_frame
        mine = self.arena.owner == self.row
        used = self._in_use.reshape(-1, k).sum(axis=1)
        if (used[~mine] != 0).any():
            raise AssertionError(f"pool {self.name!r}: a page in use in a frame it does not "
                                 f"hold")
        if (used[mine] == 0).any():
            raise AssertionError(f"pool {self.name!r}: holds an empty frame")
        if int(mine.sum()) != self.frames_held or int(used.sum()) != self.used_pages:
            raise AssertionError(f"pool {self.name!r}: frame or page counts disagree")
        slots = self._slots[:self._top]
        if ((slots < 0) | (slots >= self.num_pages)).any():
            raise AssertionError(f"pool {self.name!r}: a free slot outside the pool")
        if (np.unique(slots).size != slots.size or self._in_use[slots].any()
                or not mine[slots // k].all()):
            raise AssertionError(f"pool {self.name!r}: the free slots are inconsistent")
        if slots.size != self.frames_held * k - self.used_pages:
            raise AssertionError(f"pool {self.name!r}: {self.frames_held * k - self.used_pages}"
                                 f" free slots in its frames, {slots.size} listed")
