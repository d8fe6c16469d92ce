"""L2 through the engine: host hits are exact against HF under every write policy."""

import time

import pytest
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

P = SamplingParams(max_new_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def host_engine(model, policy: str = "write_through", **kw) -> Engine:
    cfg = {"page_size": 16, "device_tokens": 2048, "host_tokens": 4096, "write_policy": policy,
           **kw}
    return Engine.from_hf(model, CacheConfig(**cfg))


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_hits_served_from_host_after_a_device_flush(model, policy):
    eng = host_engine(model, policy, write_hit_threshold=1)
    prompt = rand_tokens(75, 50)
    r1 = eng.generate([prompt], P)[0]
    turn2 = prompt + r1.output_ids + rand_tokens(9, 51)
    if policy == "write_through_selective":  # a hit is what makes the prefix worth a copy
        check(model, turn2, eng.generate([turn2], P, return_logits=True)[0])
    eng.cache.flush(tiers=("device",))
    assert eng.stats()["pools"]["swa"]["pages"] == 0
    r = eng.generate([turn2], P, return_logits=True)[0]
    check(model, turn2, r)
    assert r.cached_by_tier == {"device": 0, "host": 64, "storage": 0}
    again = eng.generate([turn2], P, return_logits=True)[0]  # loaded back: a device hit now
    check(model, turn2, again)
    assert again.cached_by_tier["device"] == 80 and again.cached_by_tier["host"] == 0
    stats = eng.stats()
    assert stats["hits"]["host"] == 64 and stats["host"]["loaded"] > 0
    assert stats["host"]["bytes_moved"] > 0
    eng.close()


def test_host_flush_leaves_only_the_device(model):
    eng = host_engine(model)
    prompt = rand_tokens(60, 52)
    eng.generate([prompt], P)
    eng.cache.flush(tiers=("host",))
    assert all(p["host"] == 0 for p in eng.stats()["pools"].values())
    r = eng.generate([prompt + rand_tokens(5, 53)], P, return_logits=True)[0]
    assert r.cached_by_tier["device"] == 48 and r.cached_by_tier["host"] == 0
    eng.cache.flush(tiers=("device", "host"))
    assert eng.stats()["nodes"] == 0
    eng.close()


@pytest.mark.parametrize("slow_copies,policy", [(False, "write_through"),
                                                (True, "write_through"), (True, "write_back")])
def test_many_conversations_through_a_small_device_stay_exact(model, monkeypatch, slow_copies,
                                                              policy):
    """Device pages under pressure with host backup: load-back of one request overlaps
    another's compute, and every output matches HF. With slow copies every load-back
    poisons its device pages (NaN) as it is submitted and fills them 50 ms later, so a
    read that does not wait for its copy fails here every time."""
    if slow_copies:
        import shadowradix.tiers.mover as mover
        from shadowradix.tiers.host_tier import HostTier
        from shadowradix.tree.tier import HOST

        fast_copy, submit = mover.copy_pages, HostTier._submit

        def slow_copy(*args, **kwargs):
            time.sleep(0.05)
            return fast_copy(*args, **kwargs)

        def poisoned_submit(self, copies):
            for name, tier, _, dst in copies:
                if tier == HOST:  # after any earlier copy still reading these pages
                    self.mover.wait(self.ready_ticket({name: dst}))
                    self.cache.tensor(name)[:, dst] = float("nan")
            return submit(self, copies)

        monkeypatch.setattr(mover, "copy_pages", slow_copy)
        monkeypatch.setattr(HostTier, "_submit", poisoned_submit)
    eng = host_engine(model, policy, device_tokens=256, host_tokens=2048)
    convs = [rand_tokens(40, 60 + i) for i in range(8)]  # turn 1 overflows the device
    outs = eng.generate(convs, P)
    turn2 = [c + o.output_ids + rand_tokens(7, 70 + i)
             for i, (c, o) in enumerate(zip(convs, outs, strict=True))]
    results = eng.generate(turn2, P, return_logits=True)
    for t, r in zip(turn2, results, strict=True):
        check(model, t, r)
        assert r.cached_tokens == 32  # nothing lost: what left the device came from the host
    assert sum(r.cached_by_tier["host"] for r in results) > 0
    if slow_copies:  # copies were still running when their requests came up: the
        st = eng.stats()  # forward waited for them, or the request sat out a step
        assert st["copy_stalls"] + st["copy_deferrals"] > 0
    eng.close()


def test_bad_host_settings_are_refused():
    with pytest.raises(ValueError, match="host_tokens"):
        CacheConfig(page_size=16, host_tokens=8)
    with pytest.raises(ValueError, match="write_policy"):
        CacheConfig(host_tokens=4096, write_policy="write_sometimes")
    with pytest.raises(ValueError, match="write_hit_threshold"):
        CacheConfig(host_tokens=4096, write_hit_threshold=0)
