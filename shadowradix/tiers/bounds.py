"""The most pages one request holds at once, per pool: the sizing rule behind admission
(`CacheManager.fits_ever`) and behind `CacheConfig.device_tokens` as a byte budget, which
sizes the engine's arena before any cache exists, so it cannot ask a CacheManager."""

from __future__ import annotations

from dataclasses import dataclass

from shadowradix.layout.spec import KVLayout, Retention
from shadowradix.tree.policy import CheckpointPolicy
from shadowradix.tree.rules import MatchRule


@dataclass(frozen=True)
class RequestBounds:
    """page_size; per pool row whether it holds whole pages only (checkpoint pools); the
    rows a request holds only a window of (`capped`: its resume pages and one chunk; none
    when the policy keeps no tombstones, as every pool then keeps every page); `hold`, the
    pages before a resume point a lock keeps."""

    page_size: int
    names: tuple[str, ...]
    whole_only: tuple[bool, ...]
    capped: tuple[int, ...]
    hold: int

    @classmethod
    def of(cls, layout: KVLayout, policy: CheckpointPolicy) -> RequestBounds:
        rule = MatchRule.of(layout)
        ckpt = set(rule.checkpoint_rows)
        short = [i for i, p in enumerate(layout.pools) if p.retention is not Retention.ALL]
        return cls(layout.page_size, tuple(layout.pool_names),
                   tuple(row in ckpt for row in range(len(layout.pools))),
                   tuple(short) if policy.tombstones else (), rule.lock_pages)

    @property
    def spread(self) -> list[str]:
        """The capped pools: their pages come and go beside the tree's copies of the pages
        before them, so over an arena they may sit one to a frame (PrefixCache.fits_arena)."""
        return [self.names[row] for row in self.capped]

    def peak_pages(self, tokens: int, chunk: int = 1) -> dict[str, int]:
        """Per pool, the most pages one request of `tokens` positions, run alone in chunks
        of at most `chunk` tokens, holds at once.

        An ALL pool (every pool, when the policy keeps no tombstones) holds every page, a
        checkpoint pool every whole one. Otherwise a window or checkpoint pool holds the
        `hold` pages of its resume point (once: where the tree holds one too, the request
        reads the tree's, see CacheManager._share_held) and the pages of one chunk: at most
        ceil((chunk + ps - 1) / ps), for a chunk that starts just before a page end, and
        for a checkpoint pool only the whole pages the chunk closes. chunk=1 is the
        smallest chunk the scheduler cuts to (CacheManager.chunk_end), so that is what
        `fits_ever` asks; a larger `chunk` bounds a runner that never cuts (hold + 1 is
        also what a decoding request holds)."""
        ps = self.page_size
        total, whole = -(-tokens // ps), tokens // ps
        out = {}
        for row, name in enumerate(self.names):
            every = whole if self.whole_only[row] else total
            if row not in self.capped:
                out[name] = every
            elif self.whole_only[row]:
                out[name] = min(every, self.hold + (chunk + ps - 1) // ps)
            else:
                out[name] = min(every, self.hold + -(-(chunk + ps - 1) // ps))
        return out
