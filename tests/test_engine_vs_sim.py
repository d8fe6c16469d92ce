"""The engine and the simulator run one lifecycle (the CacheManager): replaying the same
requests with the same pool sizes and chunking, the engine on a tiny model and the
simulator over metadata-only pools report the same cached tokens, tier by tier, for
every request."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from test_engine import rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.sim.replay import CountingMover, replay
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.host_tier import HostTier


@dataclass(frozen=True)
class Prompt:
    """A trace request made of explicit tokens (the replay's TraceRequest interface)."""

    tokens: tuple[int, ...]
    output_length: int = 0
    expanded_tokens = 0  # it brings its own array: the replay needs no room for it
    sequence_hash_ids = None

    @property
    def hash_ids(self) -> tuple[int, ...]:
        return tuple(range(-(-len(self.tokens) // 512)))

    def prompt_tokens(self, out: np.ndarray | None = None) -> np.ndarray:
        return np.asarray(self.tokens, dtype=np.int32)


def conversations(n: int = 5, turns: int = 3) -> list[list[int]]:
    """Chats over one shared system prompt, turn-major: each turn extends the last."""
    system = rand_tokens(40, 1000)
    chats = [system + rand_tokens(20 + 9 * i, 1100 + i) for i in range(n)]
    order = []
    for t in range(turns):
        for i in range(n):
            if t:
                chats[i] = chats[i] + rand_tokens(30 + 7 * ((i + t) % 3), 1200 + 10 * t + i)
            order.append(list(chats[i]))
    return order


@pytest.mark.parametrize("host_tokens", [0, 640])
def test_engine_and_simulator_cache_the_same_tokens(host_tokens):
    model = tiny_model()
    ps, step = 16, 48
    eng = Engine.from_hf(model, CacheConfig(page_size=ps, device_tokens=512, window_tokens=256,
                                            host_tokens=host_tokens), step_tokens=step)
    prompts = conversations()
    engine_hits = []
    for prompt in prompts:  # one at a time, computing exactly the prompt
        (r,) = eng.generate([prompt], SamplingParams(max_new_tokens=1))
        engine_hits.append((r.cached_tokens, r.cached_by_tier["host"]))
    eng.check_integrity()

    pages = {n: p.num_pages for n, p in eng._prefix.pools.items()}
    host_pages = ({n: p.num_pages for n, p in eng._prefix.host_pools.items()}
                  if host_tokens else None)
    cache = PrefixCache(eng.layout, pages, host_pages=host_pages)
    host = (HostTier(cache, CountingMover())  # type: ignore[arg-type]
            if host_tokens else None)
    sim_hits = []
    for p in prompts:  # one replay per request, to read each one's tiers
        st = replay(cache, [Prompt(tuple(p))], chunk_pages=step // ps, host=host)
        assert st.refused == 0
        sim_hits.append((st.cached_tokens, st.host_tokens))
    assert sum(c for c, _ in engine_hits) > 0
    if host_tokens:
        assert sum(h for _, h in engine_hits) > 0, "the host tier served nothing"
    assert sim_hits == engine_hits
