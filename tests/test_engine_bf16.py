"""A bfloat16 checkpoint end to end, against transformers run in bfloat16.

transformers keeps norms, sinks, mHC and the compressors' position biases in float32
inside a bfloat16 model, so the pools take each KV form's own dtype, and the forward
follows transformers' casts op for op. What remains is reduction order (the window and
the top-k gathered instead of a masked full-length matmul, the batch's composition in
the MoE): one bfloat16 rounding (2**-8 relative) here and there in an intermediate,
which four layers may carry into a few units in the last place of the logits. TOL
allows 4 ulps of the largest logit; measured: at most 1 ulp (3.9e-3 at |logit| < 1),
most rows bit-identical. (Not added to conftest's LOGIT_DIFFS, whose largest value
speaks for the float32 bar of 1e-4.)
"""

import pytest
import torch
from tiny_model import reference_logits, tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

ULPS = 4
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bf16")
    tiny_model().save_pretrained(path)
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    return str(path), hf


def check(hf, prompt, result) -> float:
    """Within ULPS bfloat16 ulps of transformers' bf16 logits; greedy identical wherever
    transformers' top two are further apart than twice that."""
    n = len(result.output_ids)
    ref = reference_logits(hf, prompt + result.output_ids)[len(prompt) - 1:len(prompt) - 1 + n]
    tol = ULPS * 2.0 ** -8 * max(1.0, ref.abs().max().item())
    diff = (ref - result.logits).abs().max().item()
    assert diff <= tol, (diff, tol)
    top2 = ref.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * tol
    assert clear.any()
    assert torch.equal(result.logits.argmax(-1)[clear], ref.argmax(-1)[clear])
    return diff


def test_pools_take_the_dtype_transformers_stores_each_kv_form_in(checkpoint):
    path, hf = checkpoint
    eng = Engine.from_pretrained(path, CacheConfig(page_size=16, device_tokens=256),
                                 dtype=torch.bfloat16)
    with torch.no_grad():
        cache = hf(torch.tensor([rand_tokens(40, 1)]), use_cache=True).cache
    csa = cache.layers[1]  # tiny_model: [SWA, CSA, HCA, CSA]
    want = {"swa": cache.layers[0].keys.dtype, "c4": csa.compressed_kv["compressor"].dtype,
            "c4_index": csa.compressed_kv["indexer"].dtype,
            "c128": cache.layers[2].compressed_kv["compressor"].dtype,
            "state": csa.overlap_gate["compressor"].dtype}
    assert want["swa"] == torch.bfloat16 and want["state"] == torch.float32
    assert {p.name: p.dtype for p in eng.layout.pools} == {
        k: str(v).removeprefix("torch.") for k, v in want.items()}


@pytest.mark.parametrize("step_tokens", [512, 29])
def test_bf16_checkpoint_cold_and_with_a_cache_hit_matches_transformers_bf16(
        checkpoint, step_tokens):
    path, hf = checkpoint
    eng = Engine.from_pretrained(path, CacheConfig(page_size=16, device_tokens=2048),
                                 dtype=torch.bfloat16, step_tokens=step_tokens)
    first = [rand_tokens(75, 3), rand_tokens(40, 5)]
    cold = eng.generate(first, GREEDY, return_logits=True)
    for p, r in zip(first, cold, strict=True):
        assert r.cached_tokens == 0
        check(hf, p, r)
    second = [p + r.output_ids + rand_tokens(11, 4 + i)
              for i, (p, r) in enumerate(zip(first, cold, strict=True))]
    hits = eng.generate(second, GREEDY, return_logits=True)
    for p, prev, r, p2 in zip(first, cold, hits, second, strict=True):
        assert r.cached_tokens == (len(p) + len(prev.output_ids) - 1) // 16 * 16 > 0
        assert r.logits.dtype == torch.float32
        check(hf, p2, r)
