"""Which drafted tokens a speculative step keeps (the target model decides).

The step fed [last token, d_1 .. d_k]; row i of its logits is the target's next-token
distribution after d_i (row 0: after the last token). Greedy: keep d_1 .. d_a while each
equals the target's argmax, then emit the target's own token at row a (the correction,
or the bonus token when every draft held). Sampling, for a deterministic draft: keep d_i
with probability p_i(d_i), else draw from p_i with d_i removed and renormalised, and
stop; after k kept drafts draw the bonus from p_k. Every emitted token is then
distributed exactly as without speculation (the standard rejection rule), and a seeded
request draws the same tokens every run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.engine.sampling import distribution, sample


def verify(rows: torch.Tensor, draft: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None, banned: Sequence[set[int]]) -> list[int]:
    """The tokens the step emits: the kept drafts, then one drawn by the target (so
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
    for i, x in enumerate(draft):
        if not params.sampling:
            token = sample(rows[i], params, None, banned[i])
            out.append(token)
            if token != x:
                return out
            continue
        p = distribution(rows[i], params, banned[i]).cpu()
        if float(torch.rand((), generator=generator)) < float(p[x]):
            out.append(x)
            continue
        p[x] = 0.0  # x was rejected: draw from what is left (p[x] < 1, so something is)
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    out.append(sample(rows[k], params, generator, banned[k]))
    return out
