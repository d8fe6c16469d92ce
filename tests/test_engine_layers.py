"""Layer mixes without CSA layers (so without a state pool) resume from the cache exactly."""

import pytest
from test_engine import check, rand_tokens
from tiny_model import HCA, SWA, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("layer_types", [[SWA, SWA], [HCA, HCA], [HCA, SWA]])
def test_second_turn_hits_the_cache_without_csa_layers(layer_types):
    model = tiny_model(layer_types, seed=5)
    eng = Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=2048))
    assert "state" not in eng.layout.pool_names
    first = rand_tokens(75, 3)
    r1 = eng.generate([first], GREEDY, return_logits=True)[0]
    check(model, first, r1, greedy=True)
    second = first + r1.output_ids + rand_tokens(11, 4)
    r2 = eng.generate([second], GREEDY, return_logits=True)[0]
    assert r2.cached_tokens == (len(first) + len(r1.output_ids) - 1) // 16 * 16 > 0
    check(model, second, r2, greedy=True)
