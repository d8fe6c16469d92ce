"""Which drafted tokens a speculative step keeps (the target model decides).

The step fed [last token, d_1 .. d_k]; row i of its logits is the target's next-token
distribution after d_i (row 0: after the last token). Row by row, the target draws its
own token t_i exactly as decoding without speculation would (greedy: the argmax;
sampling: from the request's generator), and the step keeps d_{i+1} while it equals t_i;
the first t_i that differs from the draft (or t_k, when every draft held) ends the run.

For a deterministic draft this is the standard rejection rule: d is kept with
probability p(d), and on a rejection the emitted token is distributed as p with d
removed and renormalised. So every emitted token is distributed exactly as without
speculation, and beyond that a seeded request draws from its generator exactly as it
would without speculation (one draw per emitted token): its tokens do not depend on how
many drafts a step carried, on the other requests of the batch, or on speculation at all
(up to the rounding of a batched forward's logits).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.engine.sampling import sample


def verify(rows: torch.Tensor, draft: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None, banned: Sequence[set[int]]) -> list[int]:
    """The tokens the step emits: the kept drafts, then the target's own token (so
    1 .. len(draft) + 1 tokens). rows: [len(draft) + 1, vocab]; banned[i]: the tokens row
    i may not choose (min_tokens)."""
    k = len(draft)
    if not params.sampling and not any(banned):
        targets = rows.argmax(dim=-1).tolist()  # one read for the whole run
        a = 0
        while a < k and targets[a] == draft[a]:
            a += 1
        return [*draft[:a], targets[a]]
    out: list[int] = []
    for i in range(k + 1):
        token = sample(rows[i], params, generator, banned[i])
        out.append(token)
        if i == k or token != draft[i]:
            return out
    return out
