"""One generation request from admission to result."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.model.context import RequestKV
from shadowradix.tiers.storage_tier import Fetched
from shadowradix.tree.results import LockHandle, MatchResult


@dataclass
class Result:
    """What `Engine.generate` returns per prompt."""

    output_ids: list[int]
    logits: torch.Tensor | None  # float32 [len(output_ids), vocab]: the logits that chose them
    cached_tokens: int
    cached_by_tier: dict[str, int]


@dataclass
class Request:
    """
    # [0, cached)           served from the tree (locked)
    # [cached, computed)    prefilled / decoded so far: KV written to this request's pages
    # [computed, len(ids))  tokens still to feed (the rest of the prompt, or the last output)
    """

    index: int
    ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    match: MatchResult | None = None
    handle: LockHandle | None = None
    kv: RequestKV | None = None
    own: dict[str, np.ndarray] = field(default_factory=dict)  # pages allocated to it
    cached: int = 0  # tokens served from cache, any tier
    from_host: int = 0  # of those, loaded back from L2
    from_storage: int = 0  # of those, loaded from L3
    ready: int = 0  # the host-copy ticket its first forward must wait for
    prefetch: Future[Fetched] | None = None  # L3 reads for its prompt, started while it waits
    landed: int = 0  # pages of those put on the host tier (L3 -> L2), before its match
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    @property
    def outputs(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_len

    def pages_needed(self, page_size: int) -> int:
        """Pages for the whole prompt plus every token it may generate."""
        return -(-(self.prompt_len + self.params.max_new_tokens) // page_size)
