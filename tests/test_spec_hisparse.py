"""Speculative decoding with HiSparse: a verify step's rows share the hot buffers (the
union of their selections made resident, staged when it does not fit), and the entries
the drafts' windows closed are forgotten unless accepted: the accepted tokens rewrite
those addresses, so a slot still holding one would be wrong KV. Exact against
speculation and HiSparse off, whatever the drafts."""

from __future__ import annotations

import pytest
from tiny_model import reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig

PROMPTS = [[(7 * i + j * 3) % 50 + 1 for i in range(n)] for j, n in enumerate([5, 37, 70, 130])]
P = SamplingParams(max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def base(model):
    return Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096)).generate(
        PROMPTS, P, return_logits=True)


@pytest.mark.parametrize("buffer, right", [  # buffer: top-k + 1 (slots reused every step)
    (5, 0), (8, 1), (64, 0), (64, 3)])       # .. all; drafts right for `right` tokens
def test_verify_through_the_hot_buffers_is_exact(model, base, buffer: int, right: int) -> None:
    truth = [t + r.output_ids for t, r in zip(PROMPTS, base, strict=True)]

    def proposer(tokens: list[int], k: int) -> list[int]:
        full = next((f for f in truth if f[:len(tokens)] == list(tokens)), None)
        if full is None:
            return []  # off the true path already: the test fails on the tokens below
        good = full[len(tokens):len(tokens) + k]
        return good[:right] + [(t + 1) % 256 for t in good[right:]]

    cfg = CacheConfig(page_size=16, device_tokens=4096, hisparse_buffer=buffer,
                      hisparse_requests=8, debug_poison=True)
    eng = Engine.from_hf(model, cfg, speculative=SpecConfig("custom", 3, proposer=proposer))
    results = eng.generate(PROMPTS, P, return_logits=True)
    hs = eng.stats()["hisparse"]
    assert hs["fast_path_lookups"] + hs["hits"] + hs["misses"] > 0  # the buffers were read
    for a, b in zip(base, results, strict=True):
        assert a.output_ids == b.output_ids
        assert (a.logits - b.logits).abs().max() < 1e-5
    last = results[-1]
    ref = reference_logits(model, PROMPTS[-1] + last.output_ids)[len(PROMPTS[-1]) - 1:-1]
    assert (ref - last.logits).abs().max() < 1e-4
    eng.check_integrity()


def test_a_fault_in_the_hot_sets_remap_is_redone_by_the_next_step(model, base) -> None:
    """The engine marked a request's page tables current before its hot set took the new
    C4 table (`HotSet.remap`): a fault there left the hot set on the old table until the
    lease changed again, so the next step's forward ran on it (its `forget` of rejected
    drafts' entries missed the newest page). The next step now remaps first, and the
    outputs stay exact."""
    import numpy as np

    from shadowradix.sparse.hot_buffer import HotSet

    class Injected(RuntimeError):
        pass

    remap, tables, fired, stale = HotSet.remap, Engine._page_tables, [], []

    def failing_remap(self: HotSet, table: np.ndarray) -> None:
        old = self._table
        if not fired and old is not None and not np.array_equal(old, table):
            fired.append(True)  # the first call whose table changed
            raise Injected("remap")
        remap(self, table)

    def checked_tables(self: Engine, req):  # what the forward is about to read
        kv = tables(self, req)
        if not np.array_equal(kv.c4._table, req.lease.table[self.layout.index("c4")]):
            stale.append(req.lease.version)
        return kv

    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=4096, hisparse_buffer=9,
                                            hisparse_requests=1),
                         speculative=SpecConfig("ngram", 3))
    rid = eng.add_request(PROMPTS[2], P)
    out: list[int] = []
    HotSet.remap = failing_remap  # type: ignore[method-assign]
    Engine._page_tables = checked_tables  # type: ignore[method-assign]
    try:
        while eng.has_unfinished():
            try:
                steps = eng.step()
            except Injected:
                continue  # the step is put back; the next one redoes it
            out += [t for s in steps if s.request_id == rid for t in s.new_token_ids]
            eng.check_integrity()
    finally:
        HotSet.remap = remap  # type: ignore[method-assign]
        Engine._page_tables = tables  # type: ignore[method-assign]
    assert fired
    assert not stale, f"the hot set read an old C4 table at lease versions {stale}"
    assert out == base[2].output_ids
