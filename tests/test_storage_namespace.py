"""The L3 namespace names the model, not only its pools' layout: an engine of another
model (other weights, hidden size, layer order, index_topk, RoPE) over the same store
never takes the first one's objects, and stays exact."""

import copy

import pytest
import torch
from test_engine import check, rand_tokens
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.model.fingerprint import model_fingerprint
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4

P = SamplingParams(max_new_tokens=5, ignore_eos=True)
ORDER = [SWA, CSA, HCA, CSA]


def yarn(model):
    rope = copy.deepcopy(model.config.rope_parameters)
    rope["main"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=16384)
    return rope


def test_the_fingerprint_names_config_and_weights():
    base = tiny_deepseek_v4(0)
    fp = model_fingerprint(base)
    assert model_fingerprint(tiny_deepseek_v4(0)) == fp  # same config, same weights
    others = [tiny_deepseek_v4(1), tiny_deepseek_v4(0, hidden_size=96),
              tiny_deepseek_v4(0, layer_types=[SWA, CSA, CSA, HCA]),
              tiny_deepseek_v4(0, index_topk=2), tiny_deepseek_v4(0, rope_theta=20000.0),
              tiny_deepseek_v4(0, rope_parameters=yarn(base))]
    fps = [model_fingerprint(m) for m in others]
    assert fp not in fps and len(set(fps)) == len(fps)
    tuned = tiny_deepseek_v4(0)  # one weight matrix fine-tuned: a sampled element moves
    with torch.no_grad():
        next(tuned.parameters()).add_(1e-3)
    assert model_fingerprint(tuned) != fp


def test_runtime_switches_do_not_change_the_fingerprint():
    m = tiny_deepseek_v4(0)
    fp = model_fingerprint(m)
    m.config.use_cache = not m.config.use_cache
    m.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(m) == fp


@pytest.mark.parametrize("other", [
    dict(seed=1),                                 # same shapes, other weights
    dict(seed=0, hidden_size=96),                 # other hidden size, same pools
    dict(seed=0, layer_types=[SWA, CSA, CSA, HCA]),  # same layer kinds, other order
    dict(seed=0, index_topk=2),
    dict(seed=0, rope_theta=20000.0),
])
def test_an_engine_of_another_model_takes_no_storage_hits(tmp_path, other):
    url = f"file://{tmp_path / 'l3'}"
    cfg = CacheConfig(page_size=16, device_tokens=2048, storage=url)
    a = tiny_model()
    first = Engine.from_hf(a, cfg)
    prompt = rand_tokens(75, 40)
    r1 = first.generate([prompt], P)[0]
    first.close()
    overrides = {k: v for k, v in other.items() if k != "seed"}
    b = tiny_deepseek_v4(other["seed"], layer_types=overrides.pop("layer_types", ORDER),
                         **overrides)
    second = Engine.from_hf(b, cfg)
    assert second.layout.fingerprint() == first.layout.fingerprint()  # the pools agree
    turn2 = prompt + r1.output_ids + rand_tokens(9, 99)
    r = second.generate([turn2], P, return_logits=True)[0]
    assert r.cached_by_tier["storage"] == 0
    check(b, turn2, r)
    second.close()
    same = Engine.from_hf(a, cfg)  # the first model still hits its own objects
    assert same.generate([turn2], P)[0].cached_by_tier["storage"] == 64
    same.close()
