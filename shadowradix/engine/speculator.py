"""Speculative decoding's side of the engine (SpecConfig): the drafts each step carries
and the counters `Engine.stats()["spec"]` reports. Verification is engine/verify.py;
the rollback of what rejected drafts wrote is the engine's booking (compressor states
rewound, pages shrunk), so a drafter can make decoding slower, never wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from shadowradix.engine.config import SpecConfig
from shadowradix.engine.drafters import TokenDrafter
from shadowradix.engine.request import Request
from shadowradix.model.context import PagedStorage

if TYPE_CHECKING:
    from shadowradix.engine.scheduler import Chunk
    from shadowradix.model.mtp_runner import MTPRunner

Decided = dict[Request, tuple[list[int], int]]  # per request: its tokens, drafts agreed


class Speculator:
    """Drafts for decoding requests, and the acceptance counters. `Speculator(None, ...)`
    is speculation off: it drafts nothing and counts zeros.

    With an MTP block (`mtp`), drafting is forwards of the block:

        # catch_up   after the trunk's forward, before booking: the block at every position
        #            the step kept (it needs the trunk's hidden there and the next token,
        #            which the step just chose), so its KV is exact before any page is
        #            cached; its last row's argmax is the next step's first draft token
        # chain      after the next step's pages are grown: drafts 2..k, each from the
        #            block's own previous output hidden, one position further (the KV these
        #            write at positions past the accepted ones is rewritten by the next
        #            catch-up: the block's layer is sliding-window only, no state to undo)
    """

    def __init__(self, config: SpecConfig | None, vocab_size: int,
                 mtp: MTPRunner | None = None) -> None:
        self.config = config
        self.mtp = mtp
        self.drafter = TokenDrafter(config, vocab_size) if config is not None and (
            config.method != "mtp") else None
        k = config.num_draft_tokens if config is not None else 0
        self.counts: dict[str, Any] = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0,
                                       "accepted_per_position": [0] * k}

    @property
    def on(self) -> bool:
        return self.config is not None

    def draft(self, running: Sequence[Request],
              fail: Callable[[Request, Exception], None]) -> None:
        """Each decoding request's draft for this step: at most num_draft_tokens, never
        past its max_new_tokens. A proposer that raises fails its request alone."""
        assert self.config is not None
        for req in list(running):
            req.draft = []
            room = req.params.max_new_tokens - len(req.outputs) - 1
            if not req.decoding or req.lease is None or room <= 0:
                continue
            k = min(self.config.num_draft_tokens, room)
            if self.drafter is None:  # MTP: its first token now, the rest from `chain`
                if req.draft_state is not None:
                    req.draft = [req.draft_state[0]] * k
                continue
            try:
                req.draft, req.draft_state = self.drafter.propose(req.ids, req.draft_state, k)
            except Exception as e:
                fail(req, e)

    def chain(self, chunks: Sequence[Chunk], store: PagedStorage) -> None:
        """MTP: draft tokens 2..k of the step's verify chunks (their page tables built),
        one forward of the block per token, batched over the requests still drafting."""
        assert self.mtp is not None
        work = [c for c in chunks if c.end - len(c.request.ids) >= 2]
        hidden = {c.request: c.request.draft_state[1] for c in work}
        j = 1
        while work:
            segments = [(hidden[c.request], self._tokens([c.request.draft[j - 1]]),
                         c.start + j - 1, c.request.kv) for c in work]
            logits, out = self.mtp.forward(segments, store)  # type: ignore[arg-type]
            for c, rows, h in zip(work, logits, out, strict=True):
                c.request.draft[j] = int(rows[-1].argmax())
                hidden[c.request] = h
            j += 1
            work = [c for c in work if c.end - len(c.request.ids) > j]

    def catch_up(self, chunks: Sequence[Chunk], hidden: Sequence[torch.Tensor],
                 decided: Decided, store: PagedStorage) -> dict[Request, tuple[int, Any]]:
        """MTP: the block over every position each chunk kept (the trunk's `hidden` rows
        and the tokens after them); returns each request's next first draft token and
        the block's hidden there (its `draft_state`, set when its booking holds)."""
        assert self.mtp is not None
        work, segments = [], []
        for c, rows in zip(chunks, hidden, strict=True):
            req = c.request
            if req.error is not None:
                continue  # failed alone while its tokens were chosen
            tokens = decided[req][0] if req in decided else []
            seq = req.ids + tokens
            end = len(seq) - 1 if tokens else c.end  # the positions kept
            work.append(req)
            segments.append((rows[:end - c.start], self._tokens(seq[c.start + 1:end + 1]),
                             c.start, req.kv))
        if not segments:
            return {}
        logits, out = self.mtp.forward(segments, store)  # type: ignore[arg-type]
        return {req: (int(rows[-1].argmax()), h[-1:])
                for req, rows, h in zip(work, logits, out, strict=True)}

    def count(self, proposed: int, accepted: int) -> None:
        """One verified draft of `proposed` tokens, of which the answer kept `accepted`."""
        counts = self.counts
        counts["drafts"] += 1
        counts["draft_tokens"] += proposed
        counts["accepted_tokens"] += accepted
        for i in range(accepted):
            counts["accepted_per_position"][i] += 1

    def stats(self) -> dict[str, Any]:
        """method (None when off), num_draft_tokens, drafts (verify steps that carried a
        draft), draft_tokens, accepted_tokens, accepted_per_position[i] (drafts whose
        (i+1)-th token was kept) and mean_accepted_length (tokens emitted per draft step,
        the model's own token included; None before the first draft)."""
        counts, config = self.counts, self.config
        drafts = counts["drafts"]
        return {"method": config.method if config else None,
                "num_draft_tokens": config.num_draft_tokens if config else 0,
                **counts, "accepted_per_position": list(counts["accepted_per_position"]),
                "mean_accepted_length": (counts["accepted_tokens"] + drafts) / drafts
                if drafts else None}

    def _tokens(self, ids: list[int]) -> torch.Tensor:
        """Token ids on the model's device."""
        assert self.mtp is not None
        return torch.tensor(ids, device=self.mtp.hf.lm_head.weight.device)
