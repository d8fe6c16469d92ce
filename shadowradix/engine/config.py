"""CacheConfig and SamplingParams: explicit configuration, checked at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from numbers import Real
from typing import Any

from shadowradix.tiers.host_tier import WRITE_POLICIES
from shadowradix.tiers.storage.codec import check_secret
from shadowradix.tiers.storage.redis import check_url_options
from shadowradix.tiers.storage.redis_cluster import parse_cluster_url
from shadowradix.tiers.storage.urls import redact
from shadowradix.tree.policy import named_policy

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (as in SGLang and vLLM)
SEED_LIMIT = 2 ** 63


def _is_int(value: Any) -> bool:
    """An int that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(storage: Any) -> Any:
    """A storage value fit for a message: a URL without its credentials (also one given
    as bytes, which is refused, but whose repr would show them)."""
    if isinstance(storage, bytes | bytearray):
        return redact(bytes(storage).decode("utf-8", "replace"))
    return redact(storage) if isinstance(storage, str) else storage


def _is_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass(frozen=True, repr=False)
class CacheConfig:
    """How much cache the engine keeps, and where.

    page_size: tokens per logical page (a multiple of every compression ratio).
    device_tokens: L1 capacity in logical tokens, a shorthand for `device_bytes`: the bytes
        that many tokens take in every pool (whole frames, HiSparse's hot buffers besides),
        as one arena. One request may hold more tokens than this (it keeps only its
        window's pages of the sliding-window pool); `Engine.max_sequence_len` says how
        many. With `window_tokens` or `state_tokens` set, every pool is instead a fixed
        tensor of its own sized from it (the layout before the arena, for comparison).
    device_bytes: L1 capacity in bytes, one arena every device pool draws its pages from
        (pool/arena.py), so the window pool grows and shrinks against the others with what
        the workload uses; HiSparse's hot buffers are set apart from it. None: the bytes
        of `device_tokens`. With it, `window_tokens` and `state_tokens` must be None, and
        `device_tokens` sizes only the C4 pool HiSparse keeps in host memory.
    host_tokens: L2 capacity in logical tokens (0: no host tier). Host pools mirror
        the device pools; pages evicted from the device stay reusable from there.
    write_policy: when device pages are copied to the host: "write_through" (every
        page the cache adopts), "write_through_selective" (a prefix once matches
        reached it `write_hit_threshold` times) or "write_back" (only when the
        device evicts it).
    storage: L3, "file:///dir", "redis://host:port/db" or "redis-cluster://host:port,..."
        (seed nodes of a Redis/Valkey Cluster): computed pages are written through, and
        a request that misses the device loads what it can from there.
    storage_cap_bytes: for file://, the directory's size cap (least recently used
        objects go first); None: no cap. Redis caps itself (maxmemory).
    storage_secret: a secret shared by every engine using the store (bytes or str, at
        least 16 bytes once surrounding whitespace is dropped, as the server drops it
        from a secret file; longer than 64 bytes is fine): each object then carries a
        keyed digest (HMAC-SHA256) over its header and payload, bound to its key and
        namespace, and an object that fails it
        is a counted miss ("forged"), so only holders of the secret can change what an
        engine reads. None: objects are only checksummed, which detects corruption but
        authenticates nothing: the store must then be trusted like the model's weights.
        Never shown in a repr.
    hisparse_buffer: HiSparse (DESIGN.md §6): C4 entries per request per CSA layer kept
        on the device; None turns it off. At least the model's index_topk + 1 (the engine
        checks, naming the minimum). The C4 pool then lives in host memory (pinned on
        CUDA), sized like the other pools from `device_tokens`, still owned and shared by
        the tree; the device holds each running request's hot buffers instead.
    hisparse_requests: with HiSparse, how many hot-buffer sets the device holds: at most
        this many requests run at once. None: as many as fit in the bytes the C4 pool
        would have taken on the device (so turning HiSparse on never grows device memory):
        `device_tokens`' C4 pages, or C4's share of `device_bytes` (its pages where every
        pool holds the same tokens); at least one set (which may be more than C4's share
        of a tiny budget).
    window_tokens: the sliding-window pool's size in tokens, a fixed pool of its own
        (None: the arena). Setting it, or `state_tokens`, makes every pool fixed, sized
        from `device_tokens` unless set apart here. A running request keeps only its window and
        resume pages there, so a window pool several times smaller than the sequences
        it serves is enough; the rest of it caches windows for later hits.
    state_tokens: the compressor-state pool's size, in tokens of sequence it can checkpoint
        (one entry per page: state_tokens / page_size entries), a fixed pool of its own
        (None: the arena, or `device_tokens` where `window_tokens` is set). A running
        request holds only the pages of its resume point and the one it is writing, and the
        tree one per kept checkpoint, so a pool far smaller than the sequences is enough;
        the bytes go to the other pools.
    policy: which resume points the tree keeps (tree/policy.py): "shadowradix", the
        default (sequence ends, branch points, learned offsets before sequence ends, every
        16 pages), or a static setting for comparison: "end-only", "periodic-K",
        "eager-swa", "no-shadows". Never changes a logit, only what is cached.
    prefix_reuse: False makes every request compute its whole prompt, as with no prefix
        cache at all (SGLang's --disable-radix-cache): a baseline for benchmarks. Pages
        are managed as usual; only the match is skipped.
    debug_poison: fill every page with NaN when it is handed out, so a read of a page
        the reader no longer owns (or of one whose copy has not landed) shows in the
        logits. For tests; costs a write per allocated page.
    """

    page_size: int = 256
    device_tokens: int = 65536
    device_bytes: int | None = None
    host_tokens: int = 0
    write_policy: str = "write_through"
    write_hit_threshold: int = 2
    storage: str | None = None
    storage_cap_bytes: int | None = None
    storage_secret: bytes | str | None = field(default=None, repr=False)
    hisparse_buffer: int | None = None
    hisparse_requests: int | None = None
    window_tokens: int | None = None
    state_tokens: int | None = None
    policy: str = "shadowradix"
    prefix_reuse: bool = True
    debug_poison: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if not _is_int(self.device_tokens) or self.device_tokens < self.page_size \
                or self.device_tokens % self.page_size:
            raise ValueError(f"device_tokens must be a positive multiple of page_size "
                             f"({self.page_size}), got {self.device_tokens!r}")
        if self.device_bytes is not None:
            if not _is_int(self.device_bytes) or self.device_bytes < 1:
                raise ValueError(f"device_bytes must be None or an int >= 1, "
                                 f"got {self.device_bytes!r}")
            apart = [n for n in ("window_tokens", "state_tokens") if getattr(self, n) is not None]
            if apart:
                raise ValueError(f"{' and '.join(apart)} size pools of their own; with "
                                 f"device_bytes every pool shares one arena (leave them None)")
        # device_tokens then sizes only HiSparse's C4 pool in host memory
        if not _is_int(self.host_tokens) or self.host_tokens < 0 \
                or self.host_tokens % self.page_size:
            raise ValueError(f"host_tokens must be 0 (no host tier) or a positive multiple of "
                             f"page_size ({self.page_size}), got {self.host_tokens!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}, "
                             f"got {self.write_policy!r}")
        if not _is_int(self.write_hit_threshold) or self.write_hit_threshold < 1:
            raise ValueError(f"write_hit_threshold must be an int >= 1, "
                             f"got {self.write_hit_threshold!r}")
        if self.storage is not None and (not isinstance(self.storage, str) or not
                                         self.storage.startswith(("file://", "redis://",
                                                                  "rediss://",
                                                                  "redis-cluster://"))):
            hint = (f"; for a directory use storage=f'file://{self.storage}'"
                    if hasattr(self.storage, "__fspath__") else "")  # a pathlib.Path
            raise ValueError(f"storage must be None or a URL string, 'file:///DIR', "
                             f"'redis://HOST:PORT/DB' or 'redis-cluster://HOST:PORT,HOST:PORT'"
                             f", got {_shown(self.storage)!r}{hint}")
        if isinstance(self.storage, str) and self.storage.startswith("redis-cluster://"):
            parse_cluster_url(self.storage)  # a malformed seed list fails here, not at open
        if isinstance(self.storage, str) and self.storage.startswith(("redis://", "rediss://")):
            check_url_options(self.storage)  # decode_responses & co. fail here, not at open
        if self.storage_cap_bytes is not None and (
                not isinstance(self.storage_cap_bytes, int)
                or isinstance(self.storage_cap_bytes, bool) or self.storage_cap_bytes < 1
                or self.storage is None or not self.storage.startswith("file://")):
            raise ValueError(f"storage_cap_bytes must be an int >= 1 with file:// storage, "
                             f"got {self.storage_cap_bytes!r} for {_shown(self.storage)!r}")
        if self.storage_secret is not None:
            if self.storage is None:
                raise ValueError("storage_secret needs a storage URL (it authenticates the "
                                 "objects of L3)")
            check_secret(self.storage_secret)  # the type and length, naming the minimum
        if self.hisparse_buffer is not None and (
                not _is_int(self.hisparse_buffer) or self.hisparse_buffer < 2):
            raise ValueError(f"hisparse_buffer must be None (off) or an int >= index_topk + 1, "
                             f"got {self.hisparse_buffer!r}")
        if self.hisparse_requests is not None and (
                not _is_int(self.hisparse_requests) or self.hisparse_requests < 1
                or self.hisparse_buffer is None):
            raise ValueError(f"hisparse_requests must be None or an int >= 1 with "
                             f"hisparse_buffer set, got {self.hisparse_requests!r} "
                             f"(hisparse_buffer={self.hisparse_buffer!r})")
        for name in ("window_tokens", "state_tokens"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < self.page_size
                                      or value % self.page_size):
                raise ValueError(f"{name} must be None or a multiple of page_size "
                                 f"({self.page_size}), got {value!r}")
        if not isinstance(self.policy, str):
            raise ValueError(f"policy must be a name, got {self.policy!r}")
        named_policy(self.policy)  # an unknown name fails here, naming the choices
        for name in ("prefix_reuse", "debug_poison"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def __repr__(self) -> str:
        """The fields, with the storage URL's credentials hidden and the secret left out."""
        shown = (f"{f.name}={_shown(getattr(self, f.name))!r}" for f in fields(self) if f.repr)
        return f"CacheConfig({', '.join(shown)})"


@dataclass(frozen=True)
class SamplingParams:
    """Greedy, or temperature / top-k / top-p / min-p sampling reproducible from `seed`.

    temperature: below MIN_TEMPERATURE sampling is greedy (argmax), as in SGLang and vLLM:
        any finite temperature >= 0 is accepted and none can make sampling fail.
    top_k: keep the k most likely tokens (0: all). top_p: keep the most likely tokens whose
        probabilities, before each, sum to less than top_p (the most likely one always
        stays, however small top_p is). min_p: keep tokens at least min_p times as likely as
        the most likely one (0: all).
    min_tokens: outputs before the end-of-sequence token or a stop token may end the answer
        (they are never chosen before that). stop_token_ids: tokens that end the answer
        like the end-of-sequence token (the stop token is the last output); `ignore_eos`
        does not turn them off.
    """

    max_new_tokens: int = 16
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        for name in ("greedy", "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, "
                             f"got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: off), got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens = "
                             f"{self.max_new_tokens}], got {self.min_tokens!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, tuple | list) or not all(
                _is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"stop_token_ids must be a tuple of token ids (ints >= 0), "
                             f"got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    @property
    def sampling(self) -> bool:
        """Whether a token is drawn at random (not greedy, and hot enough to matter)."""
        return not self.greedy and self.temperature >= MIN_TEMPERATURE


SPEC_METHODS = ("ngram", "mtp", "custom")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: each decode step verifies up to `num_draft_tokens` drafted
    tokens in one forward and keeps the longest run the model agrees with (greedy), or
    what the rejection rule accepts (sampling: the output distribution is unchanged).

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence
        of the request's last n tokens, for n from `ngram_max` down to `ngram_min`;
        nothing when nothing matches), "mtp" (the checkpoint's own MTP block), or
        "custom" (`proposer(tokens, k)` returns up to k draft tokens for a request whose
        tokens so far are `tokens`: a drafter of your own, or a test's).
    """

    method: str = "ngram"
    num_draft_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 3
    proposer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if not _is_int(self.num_draft_tokens) or not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be an int in [1, 64], "
                             f"got {self.num_draft_tokens!r}")
        for name in ("ngram_min", "ngram_max"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be <= ngram_max "
                             f"({self.ngram_max})")
        if (self.method == "custom") != (self.proposer is not None):
            raise ValueError("a proposer is given with method='custom', and only then")
        if self.proposer is not None and not callable(self.proposer):
            raise ValueError(f"proposer must be callable, got {self.proposer!r}")
