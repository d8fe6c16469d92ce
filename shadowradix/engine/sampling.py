"""Choosing the next token from a row of logits.

Never raises for accepted parameters on finite logits: every filter keeps the most likely
token, and the temperature divides logits already shifted by their maximum (so no
temperature overflows them). Non-finite logits (a fault upstream) raise from the draw,
and fail their request alone.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from shadowradix.engine.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           banned: Collection[int] = ()) -> int:
    """Greedy argmax, or temperature + top-k + top-p + min-p sampling drawn from
    `generator`. `banned` tokens are never chosen (unless that would leave none)."""
    logits = _masked(logits, banned)
    if not params.sampling:
        return int(logits.argmax())
    return int(torch.multinomial(_weights(logits, params).cpu(), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams,
                 banned: Collection[int] = ()) -> torch.Tensor:
    """The probabilities `sample` draws from (float32, summing to 1; greedy: one-hot at
    the argmax), for speculative decoding's acceptance rule."""
    logits = _masked(logits, banned)
    if not params.sampling:
        return torch.zeros_like(logits, dtype=torch.float32).index_fill_(
            -1, logits.argmax().view(1), 1.0)
    w = _weights(logits, params)
    return w / w.sum()


def _masked(logits: torch.Tensor, banned: Collection[int]) -> torch.Tensor:
    if banned and len(banned) < logits.shape[-1]:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    return logits


def _weights(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Unnormalised sampling weights after temperature and the top-k / top-p / min-p
    filters (zero where filtered out)."""
    shifted = logits.float() - logits.max()
    probs = torch.softmax(shifted / params.temperature, dim=-1)
    if params.top_k == 0 and params.top_p >= 1.0 and params.min_p == 0.0:
        return probs
    sorted_probs, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k:
        keep[params.top_k:] = False
    if params.top_p < 1.0:
        keep &= sorted_probs.cumsum(-1) - sorted_probs < params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= sorted_probs[0] * params.min_p
    keep[0] = True  # the most likely token always stays, however tight the filters
    return torch.zeros_like(probs).scatter(-1, order[keep], sorted_probs[keep])
