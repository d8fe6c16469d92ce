"""Layouts for the model families shadowradix serves.

`deepseek_v4` reads any object with DeepseekV4Config's attributes (an HF
config, or a namespace of the published values); it never imports
transformers, so the tree and the simulator stay torch-free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from shadowradix.layout.spec import KVLayout, PoolSpec, Retention

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# SGLang's fp8 record for SWA / C4 / C128 entries: 448 fp8 "nope" dims, 64 bf16 rope dims,
# 7 one-byte scales (one per 64 dims) and a pad byte. Indexer keys: 128 fp8 + one fp32
# scale. Compressor state stays float32. Source: sgl-project/sglang,
# python/sglang/srt/mem_cache/deepseek_v4_memory_pool.py (asserts 448 + 64*2 + 8).
FP8_KV_BYTES, FP8_INDEX_BYTES = 584, 132


DEEPSEEK_V4_POOLS = ("swa", "c4", "c4_index", "c128", "state")


def deepseek_v4(hf_config: Any, page_size: int = 256, dtype: str = "bfloat16",
                name: str = "deepseek-v4", dtypes: Mapping[str, str] | None = None,
                extra_layers: Sequence[str] = ()) -> KVLayout:
    """The five pools of DeepSeek-V4 (DESIGN.md §1), counted over the config's layer types.

    swa       every layer: K (= V) of the last W-1 tokens, `head_dim` wide.
    c4        CSA layers: one compressed entry per `ratio_csa` tokens.
    c4_index  CSA layers: one indexer key per `ratio_csa` tokens, `index_head_dim` wide.
    c128      HCA layers: one compressed entry per `ratio_hca` tokens.
    state     CSA layers: the compressor state at a page end. Pages are multiples of
              every ratio, so unfinished windows are empty there and only the CSA
              overlap remains: the Ca half of the last window, `ratio_csa` rows of
              kv and of gate, for the compressor (`head_dim`) and the indexer
              (`index_head_dim`): entry shape [2, ratio_csa, head_dim + index_head_dim].
    Pools with no layers are left out (a config without HCA layers has no c128).
    dtype "fp8" gives SGLang's packed records (584 bytes per KV entry, 132 per indexer
    key, float32 state): metadata-only, for sizing and simulation.
    `dtypes` overrides `dtype` per pool, for a model whose KV forms are computed in
    different dtypes (a bfloat16 DeepSeek-V4 keeps its compress state in float32);
    names of pools the config lacks are ignored.
    `extra_layers`: the types of layers after the config's own (an MTP block's attention,
    whose KV lives in the same pools).
    """
    unknown_pools = set(dtypes or ()) - set(DEEPSEEK_V4_POOLS)
    if unknown_pools:
        raise ValueError(f"dtypes names unknown pools {sorted(unknown_pools)}; "
                         f"DeepSeek-V4 pools are {', '.join(DEEPSEEK_V4_POOLS)}")
    if dtype == "fp8":
        if dtypes:
            raise ValueError("dtype 'fp8' fixes every pool's record; pass no dtypes with it")
        return _fp8(deepseek_v4(hf_config, page_size, "bfloat16", name,
                                extra_layers=extra_layers))
    layer_types = [*hf_config.layer_types, *extra_layers]
    types = Counter(layer_types)
    unknown = set(types) - {SWA, CSA, HCA}
    if unknown:
        raise ValueError(f"unknown DeepSeek-V4 layer types {sorted(unknown)}")
    rates = hf_config.compress_rates
    r4, r128 = int(rates[CSA]), int(rates[HCA])
    hd, ihd = int(hf_config.head_dim), int(hf_config.index_head_dim)
    n_layers = len(layer_types)
    pools = [PoolSpec("swa", 1, Retention.WINDOW, (hd,), dtype, n_layers,
                      window=int(hf_config.sliding_window))]
    if types[CSA]:
        pools += [
            PoolSpec("c4", r4, Retention.ALL, (hd,), dtype, types[CSA]),
            PoolSpec("c4_index", r4, Retention.ALL, (ihd,), dtype, types[CSA]),
        ]
    if types[HCA]:
        pools.append(PoolSpec("c128", r128, Retention.ALL, (hd,), dtype, types[HCA]))
    if types[CSA]:
        pools.append(PoolSpec("state", None, Retention.CHECKPOINT, (2, r4, hd + ihd), dtype,
                              types[CSA]))
    if dtypes:
        pools = [replace(p, dtype=dtypes.get(p.name, p.dtype)) for p in pools]
    return KVLayout(name, tuple(pools), page_size)


def _fp8(layout: KVLayout) -> KVLayout:
    packed = {"swa": FP8_KV_BYTES, "c4": FP8_KV_BYTES, "c128": FP8_KV_BYTES,
              "c4_index": FP8_INDEX_BYTES}
    pools = tuple(
        replace(p, dtype="uint8", entry_bytes_override=packed[p.name]) if p.name in packed
        else replace(p, dtype="float32") for p in layout.pools)
    return KVLayout(layout.name, pools, layout.page_size)


_RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}


def _published(compress_ratios: list[int], **dims: Any) -> SimpleNamespace:
    """A config namespace from published values; `compress_ratios` has one entry per
    layer (0: sliding only, 4: CSA, 128: HCA) and a trailing MTP entry, dropped here."""
    n = dims["num_hidden_layers"]
    return SimpleNamespace(layer_types=[_RATIO_TO_TYPE[r] for r in compress_ratios[:n]],
                           compress_rates={CSA: 4, HCA: 128}, compress_ratios=compress_ratios,
                           **dims)


# DeepSeek-V4-Flash, config.json of deepseek-ai/DeepSeek-V4-Flash (Hugging Face); its dims
# are also transformers 5.23 DeepseekV4Config's defaults. 2 sliding-only, 21 CSA, 20 HCA layers.
DEEPSEEK_V4_FLASH = _published(
    [0, 0] + [4, 128] * 20 + [4, 0],
    num_hidden_layers=43, hidden_size=4096, num_attention_heads=64, head_dim=512,
    index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
)

# DeepSeek-V4-Pro, config.json of deepseek-ai/DeepSeek-V4-Pro (Hugging Face), cross-checked
# with tenstorrent/tt-metal models/demos/deepseek_v3_d_p/reference/deepseek_v4_pro_config.py.
# 30 CSA and 31 HCA layers, no sliding-only layer.
DEEPSEEK_V4_PRO = _published(
    [128, 128] + [4, 128] * 29 + [4, 0],
    num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, head_dim=512,
    index_n_heads=64, index_head_dim=128, index_topk=1024, sliding_window=128,
)


def deepseek_v4_flash(page_size: int = 256, dtype: str = "bfloat16") -> KVLayout:
    return deepseek_v4(DEEPSEEK_V4_FLASH, page_size, dtype, name="deepseek-v4-flash")


def deepseek_v4_pro(page_size: int = 256, dtype: str = "bfloat16") -> KVLayout:
    return deepseek_v4(DEEPSEEK_V4_PRO, page_size, dtype, name="deepseek-v4-pro")


def full_attention(layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                   page_size: int = 256, dtype: str = "bfloat16") -> KVLayout:
    """A Llama-like model: one ALL pool holding K and V of every token."""
    return KVLayout("full-attention",
                    (PoolSpec("kv", 1, Retention.ALL, (2, kv_heads, head_dim), dtype, layers),),
                    page_size)


def sliding_window(window: int, layers: int = 32, kv_heads: int = 8, head_dim: int = 128,
                   page_size: int = 256, dtype: str = "bfloat16") -> KVLayout:
    """A pure sliding-window model: one WINDOW pool."""
    return KVLayout("sliding-window",
                    (PoolSpec("swa", 1, Retention.WINDOW, (2, kv_heads, head_dim), dtype, layers,
                              window=window),),
                    page_size)


def hybrid_swa(window: int = 128, full_layers: int = 6, swa_layers: int = 30, kv_heads: int = 8,
               head_dim: int = 128, page_size: int = 256, dtype: str = "bfloat16") -> KVLayout:
    """Full-attention layers beside sliding-window layers (gpt-oss, Gemma-style): full + swa."""
    entry = (2, kv_heads, head_dim)
    return KVLayout("full+swa", (
        PoolSpec("full", 1, Retention.ALL, entry, dtype, full_layers),
        PoolSpec("swa", 1, Retention.WINDOW, entry, dtype, swa_layers, window=window),
    ), page_size)


def state_space(state_shape: tuple[int, ...], layers: int, page_size: int = 256,
                dtype: str = "float32") -> KVLayout:
    """A Mamba-like model: its recurrent state is just a CHECKPOINT pool."""
    return KVLayout("state-space",
                    (PoolSpec("state", None, Retention.CHECKPOINT, state_shape, dtype, layers),),
                    page_size)


LAYOUT_NAMES = ("deepseek-v4-flash", "deepseek-v4-pro", "full+swa", "full-attention",
                "sliding-window")


def named_layout(name: str, page_size: int = 256, dtype: str = "bfloat16",
                 window: int = 128) -> KVLayout:
    """A preset by name, or a DeepSeek-V4 layout from an HF `config.json` path."""
    if name == "deepseek-v4-flash":
        return deepseek_v4_flash(page_size, dtype)
    if name == "deepseek-v4-pro":
        return deepseek_v4_pro(page_size, dtype)
    if name == "full+swa":
        return hybrid_swa(window, page_size=page_size, dtype=dtype)
    if name == "full-attention":
        return full_attention(page_size=page_size, dtype=dtype)
    if name == "sliding-window":
        return sliding_window(window, page_size=page_size, dtype=dtype)
    if name.endswith(".json"):
        return deepseek_v4(_read_config(name), page_size, dtype, name=name)
    raise ValueError(f"unknown layout {name!r}: use one of {', '.join(LAYOUT_NAMES)} "
                     "or a DeepSeek-V4 config.json path")


def _read_config(path: str) -> SimpleNamespace:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read model config {path}: {e}") from None
    try:
        n = int(raw["num_hidden_layers"])
        if "layer_types" in raw:
            types = list(raw["layer_types"])[:n]
        else:
            types = [_RATIO_TO_TYPE[int(r)] for r in raw["compress_ratios"][:n]]
        return SimpleNamespace(
            layer_types=types, head_dim=int(raw["head_dim"]),
            index_head_dim=int(raw["index_head_dim"]), sliding_window=int(raw["sliding_window"]),
            compress_rates=raw.get("compress_rates") or {CSA: 4, HCA: 128})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not a DeepSeek-V4 config (missing or bad {e})") from None
