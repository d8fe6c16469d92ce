"""The MTP block: transformers' own layer, the checkpoint's names, the uncached ground truth,
and the tiny trainer end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask

from shadowradix.model.mtp import (
    PREFIX,
    MTPBlock,
    has_mtp,
    load_mtp,
    mtp_state_dict,
    random_mtp,
    save_mtp,
    trunk_forward,
)
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def trunk():
    return tiny_deepseek_v4(0, layer_types=[SWA, CSA, HCA, CSA], sliding_window=8,
                            compress_rates={CSA: 4, HCA: 16})


def _checkpoint(model, block: MTPBlock | None, path: Path, **save_kwargs) -> Path:
    model.save_pretrained(str(path), **save_kwargs)
    if block is not None:
        save_mtp(path, block)
    return path


def _assert_same_block(a: MTPBlock, b: MTPBlock) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


def test_layer_is_transformers_layer_after_the_trunk(trunk):
    block = MTPBlock(trunk.config)
    n = trunk.config.num_hidden_layers
    assert block.layer.self_attn.layer_idx == n and block.layer_idx == n
    assert block.layer.self_attn.layer_type == SWA and block.layer.self_attn.compressor is None
    assert not block.layer.mlp.is_hash
    assert type(block.layer) is type(trunk.model.layers[0])
    assert type(block.hc_head) is type(trunk.model.hc_head)
    assert trunk.config.num_hidden_layers == n and len(trunk.config.layer_types) == n


def test_layer_forward_is_the_layers_own_forward(trunk):
    """The documented sub-calls (what a paged forward will run) equal transformers' layer."""
    block = random_mtp(trunk.config, seed=3)
    torch.manual_seed(0)
    hidden = torch.randn(1, 20, trunk.config.hc_mult, trunk.config.hidden_size)
    ids = torch.randint(1, 256, (1, 20))
    pos = torch.arange(20)[None]
    mask = create_sliding_window_causal_mask(config=block.config, inputs_embeds=hidden[:, :, 0],
                                             attention_mask=None, cache=None, position_ids=pos)
    rope = {k: block.rotary_emb(hidden[:, :, 0], position_ids=pos, layer_type=k)
            for k in ("main", "compress")}
    with torch.no_grad():
        want = block.layer(hidden, position_embeddings=rope, position_ids=pos,
                           attention_mask=mask, input_ids=ids)
        got = block.layer_forward(hidden, lambda x: block.layer.self_attn(
            x, position_embeddings=rope, position_ids=pos, attention_mask=mask)[0], ids)
    assert torch.equal(got, want)


def test_trunk_hidden_is_the_input_of_hc_head(trunk):
    ids = torch.randint(1, 256, (2, 24))
    with torch.no_grad():
        logits, hidden = trunk_forward(trunk, ids)
        assert hidden.shape == (2, 24, trunk.config.hc_mult, trunk.config.hidden_size)
        again = trunk.lm_head(trunk.model.norm(trunk.model.hc_head(hidden)))
        assert torch.equal(again, logits)
        assert torch.equal(logits, trunk(input_ids=ids).logits)


def test_reference_forward_is_causal_and_sliding(trunk):
    block = random_mtp(trunk.config, seed=1)
    window = trunk.config.sliding_window
    torch.manual_seed(1)
    hidden = torch.randn(1, 32, trunk.config.hc_mult, trunk.config.hidden_size)
    ids = torch.randint(1, 256, (1, 32))
    p = 12
    hidden2, ids2 = hidden.clone(), ids.clone()
    hidden2[:, p] += 1.0
    ids2[:, p] = (ids[:, p] + 7) % 256
    with torch.no_grad():
        a, out_a = block.reference_forward(hidden, ids, trunk.model.embed_tokens, trunk.lm_head)
        b, _ = block.reference_forward(hidden2, ids2, trunk.model.embed_tokens, trunk.lm_head)
    assert a.shape == (1, 32, 256) and out_a.shape == hidden.shape
    diff = (a - b).abs().amax(-1)[0]
    assert torch.all(diff[:p] == 0), "a later token changed earlier logits"
    assert torch.all(diff[p:p + window] > 1e-4), "a token inside the window was not seen"
    assert torch.all(diff[p + window:] == 0), "a token outside the sliding window was seen"


def test_state_dict_round_trip_through_a_checkpoint(trunk, tmp_path):
    block = random_mtp(trunk.config, seed=2)
    path = _checkpoint(trunk, block, tmp_path / "ckpt")
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    stored = load_file(str(path / "model.safetensors"))
    names = {k for k in stored if k.startswith(PREFIX)}
    assert names == set(mtp_state_dict(block))
    assert {PREFIX + "attn.wq_a.weight", PREFIX + "ffn.gate.bias", PREFIX + "hc_head_fn",
            PREFIX + "ffn.experts.3.w2.weight", PREFIX + "e_proj.weight"} <= names
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    for k, v in trunk.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    again = load_mtp(path, loaded.config)
    assert again is not None and not again.training
    _assert_same_block(block, again)
    ids = torch.randint(1, 256, (1, 16))
    with torch.no_grad():
        hidden = trunk_forward(loaded, ids)[1]
        want = block.reference_forward(hidden, ids, trunk.model.embed_tokens, trunk.lm_head)[0]
        got = again.reference_forward(hidden, ids, loaded.model.embed_tokens, loaded.lm_head)[0]
    assert torch.equal(want, got)
    save_mtp(path, random_mtp(trunk.config, seed=5))  # replaces, never duplicates
    _assert_same_block(load_mtp(path, loaded.config), random_mtp(trunk.config, seed=5))


def test_sharded_checkpoint_gets_an_mtp_shard(trunk, tmp_path):
    block = random_mtp(trunk.config, seed=4)
    path = _checkpoint(trunk, block, tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"][PREFIX + "hnorm.weight"] == "model-mtp.safetensors"
    _, info = DeepseekV4ForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _assert_same_block(block, load_mtp(path, trunk.config))


def test_names_are_what_transformers_reads_for_a_real_layer(tmp_path):
    """Our `mtp.0.` names for the layer, put in place of a trunk layer of the same kind (sliding
    window, routed MoE), load through transformers' own checkpoint renaming to the same
    tensors: the names are the real checkpoint's."""
    model = tiny_deepseek_v4(0, layer_types=[SWA, SWA], mlp_layer_types=["hash_moe", "moe"],
                             sliding_window=8)
    block = random_mtp(tiny_deepseek_v4(0, layer_types=[SWA], sliding_window=8).config, seed=6)
    assert block.layer_idx == 1 and not block.layer.mlp.is_hash
    model.save_pretrained(str(tmp_path))
    stored = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
              if not k.startswith("model.layers.1.")}
    own = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_")
    for k, v in mtp_state_dict(block).items():
        name = k.removeprefix(PREFIX)
        if not name.startswith(own):
            stored["model.layers.1." + name] = v
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs = loaded.model.layers[1].state_dict()
    ours = block.layer.state_dict()
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert torch.equal(theirs[k], ours[k]), k


def test_load_mtp_refuses_bad_tensors(trunk, tmp_path):
    good = mtp_state_dict(random_mtp(trunk.config))

    def attempt(tensors, name, config_json=None):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        if config_json is not None:
            (d / "config.json").write_text(json.dumps(config_json))
        return load_mtp(d, trunk.config)

    assert attempt({"model.norm.weight": torch.ones(4)}, "none") is None
    missing = dict(good)
    del missing[PREFIX + "attn.wkv.weight"]
    with pytest.raises(ValueError, match="missing.*attn.wkv.weight"):
        attempt(missing, "missing")
    extra = {**good, PREFIX + "ffn.experts.9.w1.weight": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="unexpected.*experts.9"):
        attempt(extra, "extra")
    shaped = {**good, PREFIX + "e_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(ValueError, match="wrong shape.*e_proj"):
        attempt(shaped, "shaped")
    scaled = {**good, PREFIX + "e_proj.scale": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="quantized"):
        attempt(scaled, "scaled")
    ratios = [0, 4, 16, 4, 4]  # the MTP layer (index 4) compressed: not supported
    with pytest.raises(ValueError, match="compress ratio 4"):
        attempt(good, "ratio", {"compress_ratios": ratios})
    assert attempt(good, "ratio0", {"compress_ratios": [0, 4, 16, 4, 0]}) is not None
    kinds = [SWA, CSA, HCA, CSA]
    with pytest.raises(ValueError, match="compress"):  # transformers cuts layer_types to 4
        attempt(good, "csa", {"layer_types": [*kinds, CSA]})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        attempt(good, "dense", {"layer_types": [*kinds, SWA],
                                "mlp_layer_types": ["moe"] * 4 + ["dense"]})
    assert attempt(good, "swa", {"layer_types": [*kinds, SWA],
                                 "mlp_layer_types": ["moe"] * 5}) is not None
    for dtype in (torch.int32, torch.bool, torch.float8_e5m2):
        with pytest.raises(ValueError, match=f"dtype.*e_proj.weight: {dtype}"):
            attempt({**good, PREFIX + "e_proj.weight": good[PREFIX + "e_proj.weight"].to(dtype)},
                    f"dtype_{dtype}".replace("torch.", ""))
    for bad in (float("nan"), float("inf")):
        inf = {**good, PREFIX + "hc_head_fn": good[PREFIX + "hc_head_fn"].clone()}
        inf[PREFIX + "hc_head_fn"][0, 0] = bad
        with pytest.raises(ValueError, match="not finite.*hc_head_fn"):
            attempt(inf, f"finite_{bad}")


def test_load_mtp_reads_only_the_files_the_checkpoint_names(trunk, tmp_path):
    """The index (or model.safetensors) names the files; a stray file is not read, a
    truncated one is a ValueError naming it, a key in two named files is refused; has_mtp
    says the same from the index or the header alone."""
    block = random_mtp(trunk.config, seed=8)
    tensors = mtp_state_dict(block)
    d = _checkpoint(trunk, None, tmp_path / "plain")
    assert not has_mtp(d) and load_mtp(d, trunk.config) is None
    save_file(tensors, str(d / "stray.safetensors"))  # not the checkpoint's
    assert not has_mtp(d) and load_mtp(d, trunk.config) is None
    save_mtp(d, block)
    assert has_mtp(d)
    _assert_same_block(block, load_mtp(d, trunk.config))
    (d / "stray.safetensors").write_bytes(b"garbage")
    _assert_same_block(block, load_mtp(d, trunk.config))

    s = _checkpoint(trunk, block, tmp_path / "sharded", max_shard_size="200KB")
    index_path = s / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    assert has_mtp(s)
    save_file(mtp_state_dict(random_mtp(trunk.config, seed=9)), str(s / "model-old.safetensors"))
    _assert_same_block(block, load_mtp(s, trunk.config))
    key = PREFIX + "hnorm.weight"
    save_file({key: tensors[key]}, str(s / "model-dup.safetensors"))
    index["weight_map"]["mtp.0.hnorm_copy"] = "model-dup.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="hnorm.weight is in both"):
        load_mtp(s, trunk.config)
    del index["weight_map"]["mtp.0.hnorm_copy"]
    index_path.write_text(json.dumps(index))
    mtp_file = s / "model-mtp.safetensors"
    mtp_file.write_bytes(mtp_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="model-mtp.safetensors: unreadable") as e:
        load_mtp(s, trunk.config)
    assert "\n" not in str(e.value)
    mtp_file.unlink()
    with pytest.raises(ValueError, match="model-mtp.safetensors: unreadable"):
        load_mtp(s, trunk.config)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if not k.startswith(PREFIX)}
    index_path.write_text(json.dumps(index))
    assert not has_mtp(s) and load_mtp(s, trunk.config) is None


def test_bfloat16_keeps_transformers_float32_parts(trunk, tmp_path):
    path = _checkpoint(trunk, random_mtp(trunk.config), tmp_path / "bf16")
    block = load_mtp(path, trunk.config, dtype=torch.bfloat16)
    assert block.e_proj.weight.dtype == torch.bfloat16
    assert block.layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16
    for p in (block.enorm.weight, block.norm.weight, block.hc_head.hc_fn,
              block.layer.attn_hc.fn, block.layer.self_attn.sinks,
              block.layer.self_attn.kv_norm.weight):
        assert p.dtype == torch.float32


def test_copy_edit_prompts_fit_the_window():
    from copy_edit import EDITS, EOS, MARK, copy_edit_prompts

    a = copy_edit_prompts(20, seed=7)
    assert a == copy_edit_prompts(20, seed=7) and a != copy_edit_prompts(20, seed=8)
    for p in a:
        prompt = bytes(p.prompt)
        span = prompt[prompt.rindex(MARK) + len(MARK):-1]
        assert p.answer[-1] == EOS and len(p.answer) == len(span) + 1 <= 15
        want = bytes(ord(EDITS.get(chr(c), chr(c))) for c in span)
        assert bytes(p.answer[:-1]) == want
        assert all(0 < t < 256 for t in p.prompt + p.answer[:-1])


def test_train_tiny_quick_end_to_end(quick_checkpoint):
    out, stdout = quick_checkpoint  # train_tiny.py --quick --threads 1 --out DIR
    assert "held-out greedy accuracy" in stdout and "step    20" in stdout
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.config.layer_types == [SWA, CSA, HCA, CSA]
    block = load_mtp(out, model.config)
    assert block is not None
    ids = torch.tensor([list(b"copy: hello world\n")])
    with torch.no_grad():
        logits, hidden = trunk_forward(model.eval(), ids)
        drafts, _ = block.reference_forward(hidden, ids, model.model.embed_tokens, model.lm_head)
    assert torch.isfinite(drafts).all() and torch.isfinite(logits).all()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))  # written, so `serve --model` starts
    text = "copy: hello world, it's 4 t3st!\n"
    assert tok.eos_token_id == 0 and tok.encode(text, add_special_tokens=False) == list(
        text.encode())
    assert tok.decode([*text.encode(), 0], skip_special_tokens=True) == text


def test_an_engine_refuses_an_mtp_block_built_for_another_model(trunk):
    """A block of another hidden size, hc_mult or head_dim, or in another dtype than the
    trunk, was accepted and failed in the first step with a shape or dtype error."""
    from shadowradix import CacheConfig, Engine, SpecConfig
    from shadowradix.model.mtp import cast_block
    from shadowradix.model.tiny import tiny_config

    def build(block):
        return Engine.from_hf(trunk, CacheConfig(page_size=16, device_tokens=1024),
                              speculative=SpecConfig("mtp", 3), mtp=block)

    for other in ({"hidden_size": 32}, {"hc_mult": 4}, {"head_dim": 16}):
        config = tiny_config(**other)
        with pytest.raises(ValueError, match="not built for this model's config"):
            build(MTPBlock(config))
    with pytest.raises(ValueError, match="bfloat16 on cpu, this model's block has it "
                                         "torch.float32"):
        build(cast_block(random_mtp(trunk.config), torch.bfloat16))
    partly = cast_block(random_mtp(trunk.config), torch.bfloat16)
    partly.e_proj.weight.data = partly.e_proj.weight.data.float()  # the rest still bf16
    with pytest.raises(ValueError, match="h_proj.weight is torch.bfloat16"):
        build(partly)
    build(random_mtp(trunk.config)).close()  # its own block is taken
    import copy  # and a block cast whole beside a trunk cast whole (its norms bf16 too)

    whole = copy.deepcopy(trunk).to(torch.bfloat16)
    Engine.from_hf(whole, CacheConfig(page_size=16, device_tokens=1024),
                   speculative=SpecConfig("mtp", 3),
                   mtp=random_mtp(trunk.config).to(torch.bfloat16)).close()
    for other in ({"sliding_window": 16}, {"rope_theta": 5.0}, {"n_routed_experts": 8}):
        config = tiny_config(**other)
        with pytest.raises(ValueError, match="not built for this model's config"):
            build(MTPBlock(config))
