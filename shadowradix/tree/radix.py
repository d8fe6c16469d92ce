"""ShadowRadix: one logical radix tree, one shadow per physical pool.

Edges are runs of whole pages. A node holds tokens and, per pool, one physical
page id per logical page (or -1: a tombstone). The tree never allocates; it
adopts the pages a request hands it and reports the pages it lets go, which
the caller frees. No torch here: the simulator drives this at full scale.

    # [0, prefix_len)            resumable: every pool the match rule needs is here
    # [prefix_len, logical_len)  tokens known, some window / state page is gone

With a host tier (HiCache L2) every node has a second shadow, `host`, and each
(page, pool) lives on the device, the host, both or neither. Eviction runs per
tier: a node that loses its device pages but is backed up on the host stays in
the tree, host-only, and a match resumes through it once the caller has copied
the host pages back and `fill`ed the device shadow.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.tree.eviction import Eviction
from shadowradix.tree.lifetime import Ghost, LooseLifetime
from shadowradix.tree.node import PAGE, Node, leading_equal_pages
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.relocate import PageOwners
from shadowradix.tree.results import (
    FREE,
    HELD,
    LOCKING,
    ROLLING,
    UNLOCKING,
    InsertResult,
    LockHandle,
    MatchResult,
    Peek,
    _Probe,
)
from shadowradix.tree.resume import MAX_OFFSET, ResumeOffsets, check_prompt
from shadowradix.tree.rules import MatchRule
from shadowradix.tree.stats import TreeStats, count_stats
from shadowradix.tree.tier import DEVICE, HOST

TOKEN = np.int32


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous int32 array. Raises ValueError on anything else.

    The tree only compares ids, so it checks their type, not their range
    (the engine checks ids against the vocabulary).
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    if arr.dtype == TOKEN or arr.size == 0:
        return np.ascontiguousarray(arr, dtype=TOKEN)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.min() < _TOKEN_MIN or arr.max() > _TOKEN_MAX:
        raise ValueError("token ids must fit in int32")
    return arr.astype(TOKEN)


_TOKEN_MIN, _TOKEN_MAX = int(np.iinfo(TOKEN).min), int(np.iinfo(TOKEN).max)


class ShadowRadix(Eviction):
    """The logical tree over token positions, with per-pool shadows and two lock counts.
    Eviction, per tier and pool, is in tree/eviction.py."""

    def __init__(self, layout: KVLayout, policy: CheckpointPolicy | None = None, *,
                 host: bool = False) -> None:
        self.layout = layout
        self.tiers = 2 if host else 1
        self.policy = policy or CheckpointPolicy()
        self.rule = MatchRule.of(layout)
        self.page_size = layout.page_size
        self.n_pools = len(layout.pools)
        # WINDOW and CHECKPOINT rows: the pools whose pages can be tombstoned.
        self.short_lived_rows = [i for i, p in enumerate(layout.pools)
                                 if p.retention is not Retention.ALL]
        self.root = self._new_node(np.empty(0, TOKEN), np.empty((self.n_pools, 0), PAGE), None, 0)
        self._clock = 0
        self._held = [[0] * self.n_pools for _ in range(self.tiers)]  # pages, per tier and pool
        # Of those, the pages a lock pins (never evictable): ALL rows of full-locked nodes,
        # window-locked pages of short-lived rows (every row of a locked node when
        # tombstones are off). held - pinned is what eviction can deliver.
        self._pinned = [[0] * self.n_pools for _ in range(self.tiers)]
        tomb = self.policy.tombstones
        self.full_pin_rows = (list(self.rule.all_rows) if tomb else list(range(self.n_pools)))
        self.window_pin_rows = self.short_lived_rows if tomb else []
        # One tier with tombstones: ALL rows are never tombstoned, so a node's full pin is
        # n_pages in each of them (no need to look at its shadows).
        self._whole_full_pin = self.tiers == 1 and tomb
        self._n_nodes = 1
        self.needs_repair = False  # a repair after a fault was itself cut short (`repair`)
        # Lock and unlock walks not through (`_noted_walk`): what a fault cut short is
        # finished by `finish_rollbacks`, which the cache's next operation runs.
        self.unwinding: list[LockHandle] = []
        self.resume = ResumeOffsets()  # read only under policy.learn_resume
        self.lifetime = LooseLifetime()  # read only under policy.adaptive_lifetime
        # Which node holds each device page, for moving them (an arena's compaction): off
        # unless `track_owners` is called, as it costs a little at every insert.
        self.owners: PageOwners | None = None
        self._init_eviction()

    def track_owners(self, sizes: Mapping[str, int]) -> PageOwners:
        """Start remembering which node holds each device page (tree/relocate.py) of pools
        of `sizes` pages (by name); call it on an empty tree."""
        if self.root.children:
            raise ValueError("track_owners needs an empty tree")
        if self.owners is None:
            self.owners = PageOwners([sizes[p.name] for p in self.layout.pools])
        return self.owners

    # ------------------------------------------------------------------ match
    def match_prefix(self, tokens: Sequence[int] | np.ndarray, *,
                     record: bool = True) -> MatchResult:
        """The deepest exact resume point for `tokens`; see MatchResult.

        Never allocates or evicts. It may split a node so that a node ends at
        the resume point (the lock target). With `record` (the default) it also
        counts the match: LRU stamps and hit counts along the path and, under the
        branch-point policy, a checkpoint mark at a logical hit deeper than the
        resume point. An admission that may still be refused matches with
        record=False and calls `record` once it goes ahead.
        """
        tokens = as_tokens(tokens)
        probe = self._probe(tokens)
        path, depth, resume = probe.path, probe.depth, probe.resume
        target, tail = self._node_ending_at(path, resume)
        deepest = path[-1][0] if path else self.root
        tiers = self.tiers > 1
        m = MatchResult(resume * self.page_size, depth * self.page_size,
                        probe.table[:, :resume].copy(), target,
                        probe.on_device * self.page_size if tiers else None,
                        probe.host, probe.load, deepest, tail, self._ghost(tokens, probe))
        if record:
            self.record(m)
        return m

    def record(self, m: MatchResult) -> Node | None:
        """Count a match that goes ahead: LRU stamps and hits on the nodes it reached,
        and a branch mark at its logical depth when that lies past its resume point.
        Returns the tail a split for that mark cut off (see MatchResult.tail), or None."""
        self._clock += 1
        deepest = m.deepest if m.deepest is not None and m.deepest.alive else m.node
        node: Node | None = deepest
        while node is not None and node is not self.root:
            node.last_access = self._clock
            node.hits += 1
            node = node.parent
        if self.policy.learn_resume:
            self._learn(m, deepest)
        if self.policy.adaptive_lifetime and self.tiers == 1:
            self._weigh(m)
        if (self.policy.branch_points and m.logical_len > m.prefix_len and deepest is not None
                and deepest.alive and deepest is not self.root):
            depth = m.logical_len // self.page_size
            tail = None
            if deepest.start_page < depth < deepest.end_page:
                tail, deepest = deepest, self._split(deepest, depth - deepest.start_page)
            if deepest.end_page == depth:
                deepest.branch = True
            return tail
        return None

    def _ghost(self, tokens: np.ndarray, probe: _Probe) -> Ghost | None:
        """The evicted leaf a match would have gone on into (adaptive_lifetime, one tier):
        its walk stopped at a node's end for want of a child, where a leaf was let go."""
        if not self.policy.adaptive_lifetime or self.tiers > 1 or not len(self.lifetime):
            return None
        ps = self.page_size
        last = probe.path[-1] if probe.path else None
        if last is not None and last[1] < last[0].n_pages:
            return None  # it stopped inside a node: that is a fork, not a missing child
        if (probe.depth + 1) * ps >= tokens.size:
            return None  # nothing left past it that a child could have served
        at = self.root if last is None else last[0]
        ghost = self.lifetime.find(at.id, tokens[probe.depth * ps:(probe.depth + 1) * ps]
                                   .tobytes())
        if ghost is None:
            return None  # at most the pages this prompt has left past the stop
        return ghost._replace(pages=min(ghost.pages, (tokens.size - 1) // ps - probe.depth))

    def _weigh(self, m: MatchResult) -> None:
        """What the match missed, for the loose points' lifetime (tree/lifetime.py): the
        pages between its resume point and its logical hit, and a ghost's pages."""
        ps = self.page_size
        loose, leaf = (m.logical_len - m.prefix_len) // ps, 0
        if m.ghost is not None:
            self.lifetime.forget(m.ghost)
            if m.ghost.loose:
                loose += m.ghost.pages
            else:
                leaf += m.ghost.pages
        if loose or leaf:
            self.lifetime.observe(loose, leaf)

    def _learn(self, m: MatchResult, deepest: Node | None) -> None:
        """Count how far before the end of the sequence it matched into a match's logical
        hit stopped. Only a hit that ends inside a leaf says where one sequence ends (at
        its first page too, when the leaf is its parent's only child: a split there, such
        as the one a running request's hand-over leaves, is no fork); one that ends where
        children fork is a branch point, which branch marks serve."""
        if deepest is None or deepest is self.root or not deepest.alive or deepest.children:
            return
        depth = m.logical_len // self.page_size
        parent = deepest.parent
        inside = deepest.start_page < depth or (
            depth == deepest.start_page and parent is not None and len(parent.children) == 1)
        if inside and depth <= deepest.end_page:
            prompt = deepest.prompt_end  # -1: none known
            self.resume.observe(deepest.end_page - depth,
                                prompt - depth if depth <= prompt else MAX_OFFSET)

    def peek(self, tokens: Sequence[int] | np.ndarray) -> Peek:
        """What `match_prefix` would answer, changing nothing (no split, no stamp, no hit):
        for look-ahead (admission checks, where a storage read should start)."""
        probe = self._probe(as_tokens(tokens))
        held = probe.table[:, :probe.resume]
        if probe.host is not None:
            held = np.where(held >= 0, held, probe.host)
        return Peek(probe.resume * self.page_size, probe.on_device * self.page_size,
                    probe.depth * self.page_size, held.copy(),
                    None if probe.load is None else probe.load.copy())

    def _probe(self, tokens: np.ndarray) -> _Probe:
        ps = self.page_size
        cap = max(tokens.size - 1, 0) // ps
        path = list(self._descend(tokens, cap))
        depth = sum(eq for _, eq in path)
        if path:
            table = np.concatenate([n.pages[:, :eq] for n, eq in path], axis=1)
        else:
            table = np.empty((self.n_pools, 0), PAGE)
        resume = self.rule.deepest(table)
        on_device, host, load = resume, None, None
        if self.tiers > 1:
            host = (np.concatenate([n.slot(HOST)[:, :eq] for n, eq in path], axis=1)
                    if path else np.empty((self.n_pools, 0), PAGE))
            resume = self.rule.deepest(np.where(table >= 0, table, host))
            load = self.rule.needed(self.n_pools, resume) & (table[:, :resume] < 0)
            host = host[:, :resume].copy()
        return _Probe(path, depth, table, resume, on_device, host, load)

    def _descend(self, tokens: np.ndarray, limit: int) -> Iterator[tuple[Node, int]]:
        """Walk down from the root along `tokens`, at most `limit` pages deep.

        Yields (node, pages of it that match); the last one may match only a
        head of its node (a mismatch or the limit), and then the walk ends.
        """
        ps = self.page_size
        node, depth = self.root, 0
        while depth < limit:
            child = node.children.get(tokens[depth * ps:(depth + 1) * ps].tobytes())
            if child is None:
                return
            avail = min(child.n_pages, limit - depth)
            eq = leading_equal_pages(child.tokens[:avail * ps],
                                     tokens[depth * ps:(depth + avail) * ps], ps)
            whole = eq == child.n_pages  # read before yielding: the caller may split child
            yield child, eq
            if not whole:
                return
            node, depth = child, depth + eq

    def _node_ending_at(self, path: list[tuple[Node, int]],
                        boundary: int) -> tuple[Node, Node | None]:
        """The node on `path` ending at page `boundary`, splitting one if needed; and the
        tail the split cut off (None without a split)."""
        if boundary == 0:
            return self.root, None
        for node, _ in path:
            if node.start_page < boundary <= node.end_page:
                if boundary == node.end_page:
                    return node, None
                return self._split(node, boundary - node.start_page), node
        raise AssertionError(f"boundary {boundary} is not on the matched path")

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray,
               start: int = 0, *, finished: bool = True, tier: int = DEVICE,
               prompt: int | None = None) -> InsertResult:
        """Adopt the pages a request owns for pages [start, len(tokens) // page_size).

        pages: [pools, n - start] int page ids, -1 where the request holds none.
        [0, start) is the prefix the request borrowed from its match: the tree
        owns those pages (and may have let unlocked window pages go meanwhile),
        so the request hands none of them over. Where the tree already holds a
        page for the same tokens it keeps its own and the request's copy comes
        back in `to_free`; tombstones are filled from the request. A checkpoint
        is kept at the end (when `finished`; a running request inserting its
        prefix keeps its live window to itself), at marked branch points and
        every `policy.every_pages` pages. `tier=HOST` adopts host pages instead
        (pages fetched from storage land there). `prompt`: how many of a finished
        sequence's tokens were its prompt; under `learn_resume` its leaf remembers where
        that ended, and checkpoints are kept at the offsets before it where matches were
        seen to stop (tree/resume.py). A node whose tokens the new ones leave inside it is
        split, and its part past the branch comes back as `tail` for the caller to prune.
        Mutates the tree; allocates nothing.
        """
        tokens = as_tokens(tokens)
        ps = self.page_size
        n = tokens.size // ps
        own = np.asarray(pages)
        if not 0 <= start <= n or own.ndim != 2 or own.shape != (self.n_pools, n - start):
            raise ValueError(f"pages must be [{self.n_pools}, {n} - start] for start in [0, {n}]"
                             f", got {own.shape} with start={start}")
        check_prompt(prompt)
        table = own.astype(PAGE, copy=False) if start == 0 else np.concatenate(
            (np.full((self.n_pools, start), -1, PAGE), own), axis=1)

        segments: list[Node] = []
        node, depth, tail = self.root, 0, None
        for child, eq in self._descend(tokens, n):
            if eq < child.n_pages:  # the new pages branch off inside it: it keeps the rest
                tail = child
                child = self._split(child, eq)
            segments.append(child)
            depth += eq
            node = segments[-1]
        prompt_end = int(prompt) // ps if (
            finished and prompt is not None and self.policy.learn_resume) else -1
        if prompt_end > n:  # a prompt longer than what is inserted (a preemption) ends nowhere
            prompt_end = -1
        keep = self._keep_plan(n, [s.end_page for s in segments if s.branch], finished,
                               prompt_end)
        to_free: list[np.ndarray] = []
        for seg in segments:
            lo, hi = seg.start_page, seg.end_page
            req = table[:, lo:hi]
            seg_keep = self._keep_mask(keep, lo, hi)
            if seg_keep is not None:
                seg.keep |= seg_keep
            if hi <= start:  # the borrowed prefix: the request hands over nothing here
                if seg_keep is not None:
                    self._enqueue(seg, seg_keep)
                continue
            give = req >= 0
            slot = seg.slot(tier)
            fill = give & (slot < 0)
            if self.policy.eager_window_release and tier == DEVICE:
                fill &= self._adoptable(seg_keep, hi - lo)
            drop = give & ~fill & (req != slot)
            if np.count_nonzero(fill):
                slot[fill] = req[fill]
                self._count(fill, +1, tier, seg)
                if self.owners is not None and tier == DEVICE:
                    self.owners.note(seg, np.where(fill, req, -1))
            if np.count_nonzero(drop):
                to_free.append(np.where(drop, req, -1))
            self._enqueue(seg, fill if seg_keep is None else fill | seg_keep)
        if depth < n:
            req = table[:, depth:]
            if tier == DEVICE:
                leaf = self._new_node(tokens[depth * ps:n * ps].copy(), req, node, depth)
            else:
                leaf = self._new_node(tokens[depth * ps:n * ps].copy(),
                                      np.full_like(req, -1), node, depth)
                leaf.slot(tier)[:] = req
            leaf_keep = self._keep_mask(keep, depth, n)
            if leaf_keep is not None:
                leaf.keep[:] = leaf_keep
            if self.policy.eager_window_release and tier == DEVICE:
                drop = (req >= 0) & ~self._adoptable(leaf_keep, n - depth)
                if np.count_nonzero(drop):
                    to_free.append(np.where(drop, req, -1))
                    leaf.pages[drop] = -1
            node.children[leaf.key(ps)] = leaf
            if self.owners is not None and tier == DEVICE:
                self.owners.note(leaf, leaf.pages)
            self._n_nodes += 1
            self._count(leaf.slot(tier) >= 0, +1, tier)
            segments.append(leaf)
            self._enqueue(leaf)
        self._touch(segments)
        end = segments[-1] if segments else self.root
        if prompt_end >= 0 and end is not self.root and not end.children:
            end.prompt_end = prompt_end
        if not to_free:
            empty = np.empty(0, PAGE)
            return InsertResult(end, depth, {p.name: empty for p in self.layout.pools}, tail)
        freed = np.concatenate(to_free, axis=1)
        return InsertResult(end, depth, {p.name: freed[i][freed[i] >= 0]
                                         for i, p in enumerate(self.layout.pools)}, tail)

    def _keep_plan(self, n: int, branch_ends: list[int], finished: bool,
                   prompt_end: int = -1) -> list[tuple[int, list[int]]]:
        """Per short-lived row, the sorted page indices that belong to kept checkpoints
        (`prompt_end` >= 0: where a finished sequence's prompt ended)."""
        if n == 0 or not self.short_lived_rows:
            return []
        learned = self.resume.offsets() if self.policy.learn_resume and finished else (0,)
        at_prompt = self.resume.prompt_offsets() if prompt_end >= 0 else ()
        if (finished and not branch_ends and not self.policy.every_pages
                and len(learned) == 1 and not at_prompt):  # the common case
            return self._end_plan(n)
        ends = {*branch_ends, *([n] if finished else [])}
        ends.update(n - o for o in learned[1:] if n - o > 0)
        ends.update(prompt_end - o for o in at_prompt if prompt_end - o > 0)
        if self.policy.every_pages:
            ends.update(range(self.policy.every_pages, n + 1, self.policy.every_pages))
        plan = [(row, sorted(q - 1 for q in ends)) for row in self.rule.checkpoint_rows]
        for row, k in self.rule.windows:
            if k:
                plan.append((row, sorted({q - b for q in ends for b in range(1, k + 1)
                                          if q - b >= 0})))
        return plan

    def _end_plan(self, n: int) -> list[tuple[int, list[int]]]:
        plan = [(row, [n - 1]) for row in self.rule.checkpoint_rows]
        plan += [(row, list(range(max(n - k, 0), n))) for row, k in self.rule.windows if k]
        return plan

    def _keep_mask(self, plan: list[tuple[int, list[int]]], lo: int,
                   hi: int) -> np.ndarray | None:
        """The plan's keep marks for pages [lo, hi), or None when there are none."""
        mask = None
        for row, idx in plan:
            sel = [i - lo for i in idx[bisect_left(idx, lo):bisect_left(idx, hi)]]
            if sel:
                if mask is None:
                    mask = np.zeros((self.n_pools, hi - lo), dtype=bool)
                mask[row, sel] = True
        return mask

    def _adoptable(self, keep: np.ndarray | None, n: int) -> np.ndarray:
        """Eager policy: short-lived pages are adopted only inside kept checkpoints."""
        ok = np.ones((self.n_pools, n), dtype=bool)
        ok[self.short_lived_rows] = False if keep is None else keep[self.short_lived_rows]
        return ok

    # ------------------------------------------------------------------ locks
    def lock(self, node: Node, into: list[LockHandle] | None = None) -> LockHandle:
        """Pin the path root..node (full_lock) and the window and state just before
        node's end (window_lock). Locked shadows are never evicted. A fault halfway
        locks nothing: the lock rolls back (`_roll_back`); should a second fault cut that
        short, `finish_rollbacks` (PrefixCache runs it at its next operation) or the
        owner's unlock finishes it. `into`: the owner's list of handles, which gets the
        handle before the walk starts, so that no interrupt leaves a lock nobody holds:
        the owner unlocks what its list holds unreleased."""
        if not node.alive:
            raise ValueError("cannot lock a node that was evicted")
        handle = LockHandle(node, min(self.rule.lock_pages, node.end_page))
        if into is not None:
            into.append(handle)
        self._noted_walk(handle, +1)
        return handle

    def _noted_walk(self, handle: LockHandle, step: int) -> None:
        """`_lock_walk`, the handle noted in `unwinding` until its walk is through (held or
        free): what a fault leaves half done, the next operation finishes
        (`finish_rollbacks`), and a split or another walk puts its node back first
        (`_put_back_all`). A lock cut short rolls back."""
        self.unwinding.append(handle)
        try:
            self._lock_walk(handle, step)
        except BaseException:
            if step > 0:  # the nodes it locked are unlocked again
                self._roll_back(handle)
            raise
        finally:
            if handle.progress[0] in (HELD, FREE):
                self.unwinding.remove(handle)

    def _roll_back(self, handle: LockHandle) -> None:
        """Unlock what a lock cut short took (the nodes from the deep end up to the one
        starting at its `done_from`). The handle turns from locking to rolling back in
        one store, so whoever finishes it knows which walk it is in."""
        if handle.progress[0] == LOCKING:
            self._undo_pending(handle)  # (its handler's, if a second fault cut that short)
            done = handle.progress[1]  # the rollback walks from the deep end, to there
            handle.progress = (ROLLING, None, None, handle.node.end_page if done is None else done)
        if not handle.released:
            self._lock_walk(handle, -1)

    def finish_rollbacks(self) -> list[Node]:
        """Finish the walks that faults cut short (every lock and unlock is noted in
        `unwinding` until its walk is through): a lock's rollback, an unlock; the nodes
        they were for (the caller prunes them, as after an unlock)."""
        done = []
        while self.unwinding:
            handle = self.unwinding[0]
            if handle.progress[0] in (LOCKING, ROLLING):
                self._roll_back(handle)
                done.append(handle.node)
            elif handle.progress[0] == UNLOCKING:
                self._lock_walk(handle, -1)
                done.append(handle.node)
            self.unwinding.pop(0)
        return done

    def unlock(self, handle: LockHandle) -> None:
        """Release a lock taken by `lock`. Raises ValueError when released twice. A fault
        halfway leaves the handle unreleased: unlocking it again finishes the walk. A
        handle whose lock was cut short (and not rolled back yet) is rolled back."""
        phase = handle.progress[0]
        if phase == FREE:
            raise ValueError("lock handle already released")
        if phase in (LOCKING, ROLLING):
            self._roll_back(handle)
            return
        if phase == HELD:
            handle.progress = (UNLOCKING, None, None, 0)
        self._noted_walk(handle, -1)

    def _lock_walk(self, handle: LockHandle, step: int) -> None:
        """Lock (step +1) or unlock (-1) the path from handle.node up to the node ending
        at its phase's floor (0 but when rolling a lock back), but the nodes a walk a
        fault cut short did already: those from `handle.done_from` (a page, so a node
        split since counts as done in both parts). A lock walk ends with the handle
        held, an unlock walk with it free, each in the walk's last store.

        Before a node changes, `handle.progress` notes it with its lock counts, in one
        assignment that also counts the node before it as done. A fault after the note
        puts the node's lock counts back as they were (they are all it changes; what the
        tree derives from them, `repair` makes again), so the walk resumes at that node,
        never counting one twice or not at all. Every walk two faults cut short puts its
        node back first (`_put_back_all`): restored after another walk's change, its
        counts from before would undo that one."""
        self._put_back_all(handle)
        phase, done, at, floor = handle.progress
        if step > 0:
            phase, done, at, floor = LOCKING, None, None, 0
        # Resumed at the node it was changing when a fault struck (locked still, so in the
        # tree, when the node below it was let go since), or from the handle's own node.
        node: Node | None = handle.node if at is None else at[0]
        assert node is not None
        need = max(handle.window_pages - (handle.node.end_page - node.end_page), 0)
        flip = 0 if step > 0 else 1  # the count at which a page turns pinned / unpinned
        try:
            while node is not None and node is not self.root and node.end_page > floor:
                take = min(need, node.n_pages) if need > 0 else 0
                if done is None or node.start_page < done:
                    cols = node.window_lock[node.n_pages - take:]
                    handle.progress = (phase, done, (node, node.full_lock,
                                                     cols.copy() if take else None), floor)
                    if node.full_lock == flip:
                        self._pin(node, None, step)
                    if take and self.window_pin_rows:
                        turning = cols == flip
                        if np.count_nonzero(turning):
                            mask = np.zeros(node.n_pages, dtype=bool)
                            mask[node.n_pages - take:] = turning
                            self._pin(node, mask, step)
                    node.full_lock += step
                    if take:
                        cols += step
                    done = node.start_page  # (noted with the next node, or at the end)
                need -= take
                node = node.parent
            handle.progress = (HELD if step > 0 else FREE, None, None, 0)
            if self.needs_repair:  # it put back a node a fault had cut short: the pins
                self.repair()  # it moved since are off from those of that node
        except BaseException:
            self.needs_repair = True  # a store first: made again whatever cuts this short
            self._undo_pending(handle)
            self.repair(after_fault=True)
            raise

    def _put_back_all(self, handle: LockHandle | None = None) -> None:
        """Put back the node of every walk not through (`unwinding`, and `handle`) that a
        fault left changed: before any other change to a node's lock counts or shape."""
        if handle is not None:
            self._undo_pending(handle)
        for other in self.unwinding:
            self._undo_pending(other)

    def _undo_pending(self, handle: LockHandle) -> None:
        """Put back the lock counts of the node a walk was changing when a fault struck
        (idempotent: it writes what they were), and keep the node as where the walk
        resumes; what the tree derives from the counts is made again at its next
        operation."""
        phase, done, pending, floor = handle.progress
        if pending is None:
            return
        node, full_lock, cols = pending
        if full_lock is None:
            return
        self.needs_repair = True
        node.full_lock = full_lock
        if cols is not None and cols.size <= node.n_pages:
            node.window_lock[node.n_pages - cols.size:] = cols
        handle.progress = (phase, done, (node, None, None), floor)

    def _pin(self, node: Node, cols: np.ndarray | None, step: int) -> None:
        """Pinned counts as a node's full lock (cols None) or some window locks turn.
        Plain loops: this runs for every node a lock walks, on arrays of a few pages."""
        if cols is None:
            if self._whole_full_pin:
                pinned, n = self._pinned[0], step * node.n_pages
                for row in self.full_pin_rows:
                    pinned[row] += n
                return
            for tier in range(self.tiers):
                slot, pinned = node.slot(tier), self._pinned[tier]
                for row in self.full_pin_rows:
                    pinned[row] += step * int(np.count_nonzero(slot[row] >= 0))
            return
        for tier in range(self.tiers):
            slot, pinned = node.slot(tier), self._pinned[tier]
            for row in self.window_pin_rows:
                pinned[row] += step * int(np.count_nonzero(slot[row, cols] >= 0))

    def evictable(self, pool: str, tier: int = DEVICE) -> int:
        """Pages of `pool` in `tier` that eviction can let go now (held and not pinned by a
        lock). Does not change anything; O(1)."""
        row = self.layout.index(pool)
        return self._held[tier][row] - self._pinned[tier][row]

    def evictable_rows(self, tier: int = DEVICE) -> list[int]:
        """`evictable` of every pool, by row. O(pools)."""
        return [h - p for h, p in zip(self._held[tier], self._pinned[tier], strict=True)]

    # ------------------------------------------------------------------ tiers
    def fill(self, node: Node, table: np.ndarray, tier: int) -> None:
        """Adopt pages into one tier along the path root..node.

        table: [pools, node.end_page] page ids, -1 where nothing is handed over.
        Every cell handed over must be empty in that tier (a load-back fills
        device pages the match said were missing; a backup fills host pages
        `absent` reported). Raises ValueError, changing nothing, otherwise; a
        fault halfway changes nothing either (the tree repairs what it derives).
        """
        table = np.asarray(table, dtype=PAGE)
        if not node.alive or table.shape != (self.n_pools, node.end_page):
            raise ValueError(f"fill needs a live node and a [{self.n_pools}, {node.end_page}] "
                             f"table, got {table.shape}")
        given = []
        for walk in self.path(node):
            seg = table[:, walk.start_page:walk.end_page]
            give = seg >= 0
            if np.count_nonzero(give):
                if np.count_nonzero(walk.slot(tier)[give] >= 0):
                    raise ValueError(f"fill: node {walk.id} already holds some of these pages")
                given.append((walk, seg, give))
        try:
            for walk, seg, give in given:
                walk.slot(tier)[give] = seg[give]
                if self.owners is not None and tier == DEVICE:
                    self.owners.note(walk, np.where(give, seg, -1))
                self._count(give, +1, tier, walk)
                self._enqueue(walk)
        except BaseException:  # as it was: the caller still owns every page it gave
            for walk, _, give in given:
                walk.slot(tier)[give] = -1
            self.repair(after_fault=True)
            raise

    def unfill(self, node: Node, table: np.ndarray, tier: int) -> None:
        """Undo a `fill` of `table` along root..node in `tier` (nothing else changed since):
        the cells holding its ids go back to -1 and the counts are made again. Idempotent:
        where the fill never happened (or undid itself) it changes nothing."""
        table = np.asarray(table, dtype=PAGE)
        taken = False
        for walk in self.path(node):
            seg = table[:, walk.start_page:walk.end_page]
            slot = walk.slot(tier)
            mask = (seg >= 0) & (slot == seg)
            if np.count_nonzero(mask):
                slot[mask] = -1
                taken = True
        if taken:
            self.repair(after_fault=True)

    def absent(self, node: Node, tier: int, min_hits: int = 0) -> np.ndarray:
        """[pools, node.end_page]: pages on the path root..node held by the other tier
        but not by `tier` (what a backup to the host would copy), in nodes matched at
        least `min_hits` times."""
        out = np.zeros((self.n_pools, node.end_page), dtype=bool)
        other = self.tiers - 1 - tier
        for walk in self.path(node):
            if walk.hits >= min_hits:
                out[:, walk.start_page:walk.end_page] = (
                    (walk.slot(other) >= 0) & (walk.slot(tier) < 0))
        return out

    def adopted(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray, start: int,
                tier: int = DEVICE) -> tuple[np.ndarray, Node | None]:
        """Which cells of `pages` ([pools, n] ids for pages [start, start + n) of `tokens`,
        -1: none) the tree holds in `tier` along their path (after an insert that raised:
        those it adopted), and the deepest node the path reaches; changes nothing."""
        held, node = self.held_path(tokens, tier)
        stop = min(held.shape[1], start + pages.shape[1])
        mask = np.zeros(pages.shape, dtype=bool)
        if stop > start:
            mine = pages[:, :stop - start]
            mask[:, :stop - start] = (mine >= 0) & (held[:, start:stop] == mine)
        return mask, node

    def held_path(self, tokens: Sequence[int] | np.ndarray,
                  tier: int = DEVICE) -> tuple[np.ndarray, Node | None]:
        """One tier's page ids along `tokens`' path as far as the tree holds it, [pools,
        pages] (-1: none), and the deepest node it reaches (None: none); changes nothing."""
        tokens = as_tokens(tokens)
        path = list(self._descend(tokens, tokens.size // self.page_size))
        parts = [n.slot(tier)[:, :eq] for n, eq in path]
        table = np.concatenate(parts, axis=1) if parts else np.empty((self.n_pools, 0), PAGE)
        return table, (path[-1][0] if path else None)

    def repair(self, after_fault: bool = False) -> None:
        """After a fault cut a change short (an insert that raised): what the tree derives
        from its nodes is made again from them. The counts, every node in each eviction
        queue it may belong to (they drop the wrong ones lazily) and the page owners map.
        O(tree). Until one gets through, `needs_repair` stays set (a second fault inside
        it): the cache's next operation repairs first."""
        from shadowradix.tree.integrity import recount

        if after_fault:
            self.needs_repair = True
        n_nodes, held, pinned = recount(self)
        self._n_nodes = n_nodes
        self._held = held.tolist()
        self._pinned = pinned.tolist()
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self._enqueue(node)
            if self.owners is not None:
                self.owners.note(node, node.pages)
        self.needs_repair = False

    def path_table(self, node: Node, tier: int) -> np.ndarray:
        """One tier's page ids along root..node, as a [pools, node.end_page] table."""
        parts = [walk.slot(tier) for walk in self.path(node)]
        return np.concatenate(parts, axis=1) if parts else np.empty((self.n_pools, 0), PAGE)

    def path_tail(self, node: Node, n: int, tier: int = DEVICE) -> np.ndarray:
        """The last `n` columns of `path_table(node, tier)` (fewer near the root), walking
        up only as far as they reach: what a lock on `node` pins in the short-lived rows,
        read at every page a running request crosses, so O(n), not O(depth)."""
        parts = []
        walk: Node | None = node
        while n > 0 and walk is not None and walk is not self.root:
            take = min(n, walk.n_pages)
            parts.append(walk.slot(tier)[:, walk.n_pages - take:])
            n -= take
            walk = walk.parent
        return np.concatenate(parts[::-1], axis=1) if parts else np.empty((self.n_pools, 0), PAGE)

    def path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        out = []
        walk: Node | None = node
        while walk is not None and walk is not self.root:
            out.append(walk)
            walk = walk.parent
        return out[::-1]

    # --------------------------------------------------------------- helpers
    def _new_node(self, tokens: np.ndarray, pages: np.ndarray, parent: Node | None,
                  start: int) -> Node:
        n = pages.shape[1]
        return Node(tokens=tokens, pages=np.array(pages, dtype=PAGE),  # a copy: never alias
                    keep=np.zeros((self.n_pools, n), dtype=bool),
                    window_lock=np.zeros(n, dtype=np.int32), parent=parent, start_page=start,
                    host=np.full((self.n_pools, n), -1, PAGE) if self.tiers > 1 else None)

    def _split(self, node: Node, j: int) -> Node:
        self._put_back_all()  # (or the new head would copy a half-done walk's counts)
        try:
            head = node.split(j, self.page_size)  # all or nothing
            if self.owners is not None:
                self.owners.note(head, head.pages)
            self._n_nodes += 1
            self._enqueue(head, head.pages >= 0)  # a new node: wherever it holds pages
        except BaseException:  # split or not, what the tree derives is made again
            self.repair(after_fault=True)
            raise
        return head

    def _touch(self, nodes: Iterator[Node] | list[Node]) -> None:
        self._clock += 1
        for node in nodes:
            node.last_access = self._clock

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------ inspection
    def pages_held(self, pool: str, tier: int = DEVICE) -> int:
        return int(self._held[tier][self.layout.index(pool)])

    def all_pages(self, pool: str, tier: int = DEVICE) -> np.ndarray:
        """Every page of `pool` the tree holds in `tier` (for integrity checks)."""
        row = self.layout.index(pool)
        parts = [n.slot(tier)[row][n.slot(tier)[row] >= 0] for n in self.nodes()]
        return np.concatenate(parts) if parts else np.empty(0, PAGE)

    def stats(self) -> TreeStats:
        return count_stats(self)

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first count or link that disagrees."""
        from shadowradix.tree.integrity import check_tree

        check_tree(self)
