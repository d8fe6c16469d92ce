"""Choosing the next token from a row of logits."""

from __future__ import annotations

import torch

from shadowradix.engine.config import SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy argmax, or temperature + top-p (nucleus) sampling drawn from `generator`."""
    if params.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # always keeps the first
        probs = torch.zeros_like(probs).scatter(-1, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
