"""Speculative decoding keeps HiSparse's access streams exact: with record_topk, a verify
step records a selection for every row it fed and drops those of rejected drafts, so the
stream equals the one recorded without speculation, step for step."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig


@pytest.mark.parametrize("right", [0, 1, 2, 3])
def test_streams_equal_without_speculation(right: int) -> None:
    model = tiny_model()
    cfg = CacheConfig(page_size=16, device_tokens=4096)
    prompts = [[(7 * i + j * 3) % 50 + 1 for i in range(n)] for j, n in enumerate([5, 37, 70])]
    p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    base = Engine.from_hf(model, cfg, record_topk=True).generate(prompts, p)
    truth = [t + r.output_ids for t, r in zip(prompts, base, strict=True)]

    def proposer(tokens: list[int], k: int) -> list[int]:  # right for `right` tokens
        full = next(f for f in truth if f[:len(tokens)] == list(tokens))
        good = full[len(tokens):len(tokens) + k]
        return good[:right] + [(t + 1) % 256 for t in good[right:]]

    spec = SpecConfig("custom", 3, proposer=proposer)
    eng = Engine.from_hf(model, cfg, record_topk=True, speculative=spec)
    results = eng.generate(prompts, p)
    assert eng.stats()["spec"]["drafts"] > 0
    for a, b in zip(base, results, strict=True):
        assert a.output_ids == b.output_ids
        assert a.topk is not None and b.topk is not None and a.topk.keys() == b.topk.keys()
        for layer, sa in a.topk.items():
            sb = b.topk[layer]
            assert np.array_equal(sa.counts, sb.counts), layer
            assert np.array_equal(sa.offsets, sb.offsets), layer
            assert np.array_equal(sa.ids, sb.ids), layer
