"""Which resume points the tree keeps, and how it lets the rest go."""

from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral


@dataclass(frozen=True)
class CheckpointPolicy:
    """Checkpoints are a policy (DESIGN.md §2), not a fixed rule.

    A checkpoint at page boundary q is the WINDOW pages before q plus the
    CHECKPOINT entry at q: what a request needs to resume exactly at q.
    Kept checkpoints are evicted last.

    every_pages: also keep a checkpoint every K pages (0: off).
    branch_points: keep one where a match's logical hit went deeper than its
        resumable point (the second request that diverges at a shared system
        prompt marks it; the third hits).
    eager_window_release: SGLang's rule: WINDOW / CHECKPOINT pages that are not
        part of a kept checkpoint are freed at insert instead of cached.
    tombstones: False gives a conventional radix cache: every pool of a node
        lives and dies with the node, so SWA is never dropped on its own.
    learn_resume: the adaptive policy: also keep checkpoints a few pages before a
        finished sequence's end, or before where its prompt ended, at the offsets where
        matches were seen to stop (tree/resume.py). Learned from the matches, so it needs
        no flag per workload.
    adaptive_lifetime: under one byte budget (`ShadowRadix.evict_bytes`), loose resume
        points (every page's window and state away from a kept checkpoint) live as long
        as the misses say they are worth against whole prefixes (tree/lifetime.py):
        every page resumes while memory allows, and they thin out under pressure, oldest
        first. Off, they go before anything else.
    """

    every_pages: int = 0
    branch_points: bool = True
    eager_window_release: bool = False
    tombstones: bool = True
    learn_resume: bool = False
    adaptive_lifetime: bool = False

    def __post_init__(self) -> None:
        k = self.every_pages
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise ValueError(f"every_pages must be an int >= 0, got {k!r}")
        if self.eager_window_release and not self.tombstones:
            raise ValueError("eager_window_release needs tombstones=True")
        if self.learn_resume and not self.tombstones:
            raise ValueError("learn_resume needs tombstones=True (without them every page "
                             "is a checkpoint)")
        if self.adaptive_lifetime and not self.tombstones:
            raise ValueError("adaptive_lifetime needs tombstones=True (without them no "
                             "resume point is loose)")


# The default, for the engine and the simulator alike: checkpoints at sequence ends and
# branch points, at the offsets before sequence ends and prompt ends where matches were
# seen to stop (learned), and every 16 pages, which bounds what a match that stops anywhere else
# recomputes. In the simulator its pools also share one byte budget (sim/simulate.py).
# Measured against the best static setting at every size from 64 GB to 1 TB:
# benchmarks/policy_envelope.py, docs/policy_envelope_*.json.
DEFAULT_EVERY_PAGES = 16
DEFAULT = CheckpointPolicy(learn_resume=True, every_pages=DEFAULT_EVERY_PAGES)
# The default plus a learned lifetime for the other pages' resume points (#22, not the
# default yet): it equals a plain radix cache where memory holds a prompt-only chat's
# working set, but loses 3.6 points on the synthetic trace at 256 GB (README).
ADAPTIVE_LIFETIME = replace(DEFAULT, adaptive_lifetime=True)

# The policies the simulator compares at equal bytes (issue: simulator, section 2).
POLICIES: dict[str, CheckpointPolicy] = {
    "shadowradix": DEFAULT,
    "end-only": CheckpointPolicy(),  # the old default: sequence ends and branch points
    "eager-swa": CheckpointPolicy(eager_window_release=True),
    "no-shadows": CheckpointPolicy(tombstones=False),
    "adaptive-lifetime": ADAPTIVE_LIFETIME,
}
ALIASES = {"adaptive": "shadowradix"}  # --policy adaptive, from before it was the default


def periodic(k: int) -> CheckpointPolicy:
    return CheckpointPolicy(every_pages=k)


def named_policy(name: str) -> CheckpointPolicy:
    """A policy by name: one of POLICIES (or an alias), or "periodic-K". Raises ValueError
    naming the choices."""
    name = ALIASES.get(name, name)
    if name in POLICIES:
        return POLICIES[name]
    k = name.removeprefix("periodic-")
    if name.startswith("periodic-") and k.isdigit() and int(k) >= 1:
        return periodic(int(k))
    raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}, "
                     f"periodic-K (K >= 1) or {', '.join(ALIASES)}")
