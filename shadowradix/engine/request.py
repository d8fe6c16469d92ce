"""One generation request from `add_request` to its Result."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.model.context import RequestKV
from shadowradix.sparse import AccessStream
from shadowradix.tiers.manager import Lease
from shadowradix.tiers.storage_tier import Fetched


@dataclass
class Result:
    """What a finished request returns (`Engine.generate`, `StepOutput.result`)."""

    output_ids: list[int]
    logits: torch.Tensor | None  # float32 [len(output_ids), vocab]: the logits that chose them
    cached_tokens: int
    cached_by_tier: dict[str, int]
    # With Engine(record_topk=True): per CSA layer, the C4 entries the indexer selected at
    # each decode step (one step per output token fed back: every output but the last).
    topk: dict[int, AccessStream] | None = None


@dataclass(frozen=True)
class StepOutput:
    """What one `Engine.step` produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    result: Result | None = None  # set when finished
    # On a request's first output only (None after): the prompt tokens the cache served,
    # per tier, and when it was first admitted (time.monotonic()), for a server's usage
    # and queue-time figures before the request finishes (or if it is aborted).
    cached_by_tier: dict[str, int] | None = None
    admitted_at: float | None = None
    # Set when this request failed alone (finished, no result): a fault in its own
    # bookkeeping or sampling; the other requests of the step went on.
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    """A live request (compared by identity).

    # [0, lease.cached)     served from the cache at its (last) admission
    # [cached, computed)    prefilled / decoded so far: KV written to its pages
    # [computed, len(ids))  tokens still to feed (the rest of the prompt, or the last output)

    A preempted request keeps its ids and outputs and goes back to the queue; at its next
    admission it resumes from what the cache still holds and recomputes the rest.
    """

    id: str
    ids: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    keep_logits: bool = False
    lease: Lease | None = None
    kv: RequestKV | None = None
    kv_version: int = -1  # the lease.version its page tables were built from
    computed: int = 0
    prefetch: Future[Fetched] | None = None  # L3 reads for its prompt, started while it waits
    landed: int = 0  # pages of those put on the host tier (L3 -> L2), before its match
    admitted: bool = False  # its first admission happened (the hit counts below are from it)
    cached: int = 0  # prompt tokens served from cache at its first admission
    from_host: int = 0
    from_storage: int = 0
    admitted_at: float = 0.0  # time.monotonic() at its first admission
    logits: list[torch.Tensor] = field(default_factory=list)
    topk: dict[int, list[tuple[torch.Tensor, int]]] | None = None  # RequestKV.topk's log
    reported: int = 0  # outputs handed to the outbox
    done: bool = False
    result: Result | None = None
    error: BaseException | None = None  # it failed alone (done, no result)
    draft: list[int] = field(default_factory=list)  # this step's draft tokens (speculative)
    draft_state: Any = None  # the drafter's memory of this request

    @property
    def outputs(self) -> list[int]:
        return self.ids[self.prompt_len:]

    @property
    def cached_by_tier(self) -> dict[str, int]:
        return {"device": self.cached - self.from_host - self.from_storage,
                "host": self.from_host, "storage": self.from_storage}

    @property
    def decoding(self) -> bool:
        """One token left to feed: the last output (a decode step)."""
        return len(self.ids) - self.computed == 1

    @property
    def max_tokens(self) -> int:
        """Positions it may ever write KV for: the prompt and every output but the last."""
        return self.prompt_len + self.params.max_new_tokens - 1
