"""The public Engine against transformers' uncached forward (DESIGN.md §4 correctness bar)."""

import pytest
import torch
from conftest import LOGIT_DIFFS
from tiny_model import CSA, HCA, SWA, reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

TOL = 1e-4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def check(model, prompt, result, greedy: bool = False) -> float:
    """The logits that chose each output token equal HF's uncached forward; with `greedy`,
    each output token is also HF's argmax."""
    n = len(result.output_ids)
    ref = reference_logits(model, prompt + result.output_ids)[len(prompt) - 1:len(prompt) - 1 + n]
    diff = (ref - result.logits).abs().max().item()
    LOGIT_DIFFS.append(diff)
    assert diff <= TOL, diff
    if greedy:
        assert result.output_ids == ref.argmax(-1).tolist()
    assert result.logits.dtype == torch.float32 and result.logits.shape == ref.shape
    assert sum(result.cached_by_tier.values()) == result.cached_tokens
    return diff


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def engine(model, **kw) -> Engine:
    step = kw.pop("step_tokens", 512)
    return Engine.from_hf(model, CacheConfig(**{"page_size": 16, "device_tokens": 2048, **kw}),
                          step_tokens=step)


def test_batch_of_mixed_lengths_cold(model):
    eng = engine(model)
    prompts = [rand_tokens(n, n) for n in (5, 40, 75, 23)]
    results = eng.generate(prompts, GREEDY, return_logits=True)
    for p, r in zip(prompts, results, strict=True):
        assert r.cached_tokens == 0 and len(r.output_ids) == 6
        assert r.output_ids == r.logits.argmax(-1).tolist()
        check(model, p, r)


@pytest.mark.parametrize("step_tokens", [1, 7, 29])
def test_chunked_prefill_with_odd_budgets_and_token_by_token_decode(model, step_tokens):
    eng = engine(model, step_tokens=step_tokens)
    prompts = [rand_tokens(50, 1), rand_tokens(33, 2)]
    for p, r in zip(prompts, eng.generate(prompts, GREEDY, return_logits=True), strict=True):
        check(model, p, r)


def test_multi_turn_conversation_hits_the_previous_turn(model):
    eng = engine(model)
    prompt = rand_tokens(75, 3)
    last_computed = 0  # tokens whose KV the previous turn computed
    for turn in range(3):
        r = eng.generate([prompt], GREEDY, return_logits=True)[0]
        check(model, prompt, r)
        assert r.cached_tokens == last_computed // 16 * 16
        last_computed = len(prompt) + len(r.output_ids) - 1
        prompt = prompt + r.output_ids + rand_tokens(11, 10 + turn)


def test_shared_system_prompt_third_request_hits_at_the_branch(model):
    eng = engine(model)
    system = rand_tokens(48, 4)
    cached = []
    for i in range(3):
        prompt = system + rand_tokens(20, 20 + i)
        r = eng.generate([prompt], GREEDY, return_logits=True)[0]
        check(model, prompt, r)
        cached.append(r.cached_tokens)
    assert cached[0] == 0 and cached[2] == 48


def test_small_device_evicts_between_turns_and_stays_exact(model):
    eng = engine(model, device_tokens=160)  # 10 pages: one conversation at a time
    a = rand_tokens(70, 5)
    eng.generate([a], GREEDY)
    eng.generate([rand_tokens(100, 6)], GREEDY)
    prompt = a + rand_tokens(30, 7)
    r = eng.generate([prompt], GREEDY, return_logits=True)[0]
    check(model, prompt, r)
    assert sum(p["evicted"] for p in eng.stats()["pools"].values()) > 0


def test_requests_that_do_not_fit_now_wait_and_all_complete(model):
    eng = engine(model, device_tokens=160)
    prompts = [rand_tokens(90, 30 + i) for i in range(3)]  # only one fits at a time
    for p, r in zip(prompts, eng.generate(prompts, GREEDY, return_logits=True), strict=True):
        check(model, p, r)


@pytest.mark.parametrize("page_size, window, layer_types", [
    (128, 8, [SWA, CSA, HCA, CSA]),
    (256, 8, [CSA, HCA, CSA]),            # no pure sliding-window layer
    (128, 200, [SWA, CSA, HCA]),          # window larger than a page
])
def test_real_page_sizes_windows_and_layer_mixes(page_size, window, layer_types):
    mdl = tiny_model(layer_types, window=window, hca_ratio=128, seed=7)
    eng = Engine.from_hf(mdl, CacheConfig(page_size=page_size, device_tokens=4 * 1024))
    first = rand_tokens(300, 8)
    r1 = eng.generate([first], GREEDY, return_logits=True)[0]
    check(mdl, first, r1)
    second = first + r1.output_ids + rand_tokens(40, 9)
    r2 = eng.generate([second], GREEDY, return_logits=True)[0]
    assert r2.cached_tokens == (len(first) + 5) // page_size * page_size
    check(mdl, second, r2)


def test_seeded_sampling_is_reproducible_and_exact(model):
    eng = engine(model)
    prompt = rand_tokens(30, 11)
    params = SamplingParams(max_new_tokens=8, greedy=False, temperature=0.8, top_p=0.9, seed=3,
                            ignore_eos=True)
    a = eng.generate([prompt], params, return_logits=True)[0]
    b = eng.generate([prompt], params, return_logits=True)[0]
    assert a.output_ids == b.output_ids
    check(model, prompt, b)


def test_flush_drops_the_device_tier(model):
    eng = engine(model)
    prompt = rand_tokens(60, 12)
    eng.generate([prompt], GREEDY)
    eng.cache.flush(tiers=("device",))
    assert eng.generate([prompt], GREEDY)[0].cached_tokens == 0
    with pytest.raises(ValueError, match="cannot flush tiers"):
        eng.cache.flush(tiers=("gpu",))


@pytest.mark.parametrize("prompts, params, match", [
    ([[]], GREEDY, "empty"),
    ([[1, 2, 999]], GREEDY, "outside the vocabulary"),
    ([[1, -1]], GREEDY, "outside the vocabulary"),
    ([[1, 2.5]], GREEDY, "not an integer"),
    ([[1, True]], GREEDY, "not an integer"),
    ("hello", GREEDY, "list of token id lists"),
    ([], GREEDY, "empty"),
    ([[1, 2]], [GREEDY, GREEDY], "one per prompt"),
    ([list(range(200))] * 1, SamplingParams(max_new_tokens=50000), "pages"),
])
def test_bad_input_raises_and_the_engine_keeps_serving(model, prompts, params, match):
    eng = engine(model)
    with pytest.raises(ValueError, match=match):
        eng.generate(prompts, params)
    prompt = rand_tokens(20, 13)
    check(model, prompt, eng.generate([prompt], GREEDY, return_logits=True)[0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(greedy=False, temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=0), "page_size"),
    (dict(page_size=16, device_tokens=8), "device_tokens"),
    (dict(page_size=16, host_tokens=8), "host_tokens"),
    (dict(hisparse_buffer=1), "hisparse_buffer"),
    (dict(hisparse_buffer=True), "hisparse_buffer"),
    (dict(hisparse_buffer=8.0), "hisparse_buffer"),
    (dict(hisparse_requests=4), "hisparse_requests"),
    (dict(hisparse_buffer=8, hisparse_requests=0), "hisparse_requests"),
])
def test_invalid_cache_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_page_size_must_fit_the_model(model):
    with pytest.raises(ValueError, match="multiple"):
        Engine.from_hf(model, CacheConfig(page_size=24, device_tokens=2400))


def test_from_pretrained_loads_a_safetensors_checkpoint(model, tmp_path):
    model.save_pretrained(tmp_path)
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())
    eng = Engine.from_pretrained(str(tmp_path), CacheConfig(page_size=16, device_tokens=1024))
    prompt = rand_tokens(25, 14)
    check(model, prompt, eng.generate([prompt], GREEDY, return_logits=True)[0])
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([prompt], GREEDY)


def test_stats_report_hits_pools_and_hisparse(model):
    eng = engine(model)
    prompt = rand_tokens(40, 15)
    eng.generate([prompt], GREEDY)
    eng.generate([prompt + [1, 2, 3]], GREEDY)
    st = eng.stats()
    assert st["hits"]["device"] == 32 and st["requests"] == 2
    assert set(st["pools"]) == {"swa", "c4", "c4_index", "c128", "state"}
    assert st["hisparse"] == {"enabled": False, "hits": 0, "misses": 0, "bytes_moved": 0}


@pytest.mark.parametrize("host_tokens", [0, 1024])
def test_an_interrupted_generate_leaves_nothing_locked_or_allocated(model, monkeypatch,
                                                                     host_tokens):
    eng = engine(model, device_tokens=512, host_tokens=host_tokens)
    eng.generate([rand_tokens(45, 52), rand_tokens(45, 53)], GREEDY)  # some cache, some on host
    eng.cache.flush(tiers=("device",))
    calls = {"n": 0}
    original = eng.runner.forward_batch

    def failing(segments, store):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return original(segments, store)

    monkeypatch.setattr(eng.runner, "forward_batch", failing)
    with pytest.raises(KeyboardInterrupt):  # the second resumes from the host when it has one
        eng.generate([rand_tokens(40, 50), rand_tokens(45, 52) + rand_tokens(9, 54)], GREEDY)
    monkeypatch.setattr(eng.runner, "forward_batch", original)
    eng._prefix.check_integrity(held={})  # every page is the tree's or free, in both tiers
    assert not host_tokens or eng.stats()["host"]["loaded"] > 0
    assert all(p["locked"] == 0 for p in eng.stats()["pools"].values())
    prompt = rand_tokens(40, 50)
    check(model, prompt, eng.generate([prompt], GREEDY, return_logits=True)[0])
