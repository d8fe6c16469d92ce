from types import SimpleNamespace

import pytest

from shadowradix.layout import (
    KVLayout,
    PoolSpec,
    Retention,
    deepseek_v4,
    deepseek_v4_flash,
    deepseek_v4_pro,
    full_attention,
    hybrid_swa,
    sliding_window,
    state_space,
)
from shadowradix.layout.presets import DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO


def test_flash_matches_transformers_config():
    import transformers

    cfg = transformers.DeepseekV4Config(compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])
    assert deepseek_v4(cfg).pools == deepseek_v4_flash().pools


def test_pro_config_layer_counts_and_fp8_bytes():
    lay = deepseek_v4_pro(dtype="fp8")
    layers = {p.name: p.layers for p in lay.pools}
    assert layers == {"swa": 61, "c4": 30, "c4_index": 30, "c128": 31, "state": 30}
    bpt = lay.bytes_per_token()
    # SGLang's fp8 records: 584 B per KV entry, 132 B per indexer key.
    assert bpt["swa"] == 584 * 61
    assert bpt["c4"] == 584 / 4 * 30
    assert bpt["c4_index"] == 132 / 4 * 30
    assert bpt["c128"] == pytest.approx(584 / 128 * 31)
    assert len(DEEPSEEK_V4_PRO.layer_types) == 61


def test_deepseek_v4_pools_follow_layer_types():
    import transformers

    cfg = transformers.DeepseekV4Config(num_hidden_layers=3, head_dim=64, index_head_dim=32,
                                        layer_types=["sliding_attention",
                                                     "compressed_sparse_attention",
                                                     "compressed_sparse_attention"])
    lay = deepseek_v4(cfg, page_size=128)
    assert lay.pool_names == ("swa", "c4", "c4_index", "state")  # no HCA layer: no c128
    assert lay.pool("swa").layers == 3 and lay.pool("c4").layers == 2
    assert lay.pool("state").entry_shape == (2, 4, 64 + 32)
    assert lay.pool("c4").entries_per_page(128) == 32
    assert lay.pool("state").entries_per_page(128) == 1


def test_deepseek_v4_dtypes_override_single_pools():
    """A bfloat16 model's compress state is float32 (its gate rows carry the float32
    position bias): the pools say so, and the bytes follow."""
    lay = deepseek_v4_flash(dtype="bfloat16")
    mixed = deepseek_v4(DEEPSEEK_V4_FLASH, dtype="bfloat16", name=lay.name,
                        dtypes={"state": "float32"})
    assert {p.name: p.dtype for p in mixed.pools} == {
        "swa": "bfloat16", "c4": "bfloat16", "c4_index": "bfloat16", "c128": "bfloat16",
        "state": "float32"}
    assert mixed.page_bytes()["state"] == 2 * lay.page_bytes()["state"]
    assert mixed.fingerprint() != lay.fingerprint()
    no_hca = deepseek_v4(SimpleNamespace(**{**vars(DEEPSEEK_V4_FLASH),
                                            "layer_types": ["sliding_attention"]}),
                         dtypes={"c128": "float32", "state": "float32"})
    assert no_hca.pool_names == ("swa",)  # overrides of absent pools are ignored
    with pytest.raises(ValueError, match="unknown pools"):
        deepseek_v4(DEEPSEEK_V4_FLASH, dtypes={"kv": "float32"})
    with pytest.raises(ValueError, match="fp8"):
        deepseek_v4(DEEPSEEK_V4_FLASH, dtype="fp8", dtypes={"state": "float32"})


def test_bytes_per_token_arithmetic():
    lay = full_attention(layers=2, kv_heads=1, head_dim=4, page_size=16, dtype="float32")
    assert lay.bytes_per_token() == {"kv": 2 * 1 * 4 * 4 * 2}
    assert lay.total_bytes_per_token() == 64
    assert lay.page_bytes() == {"kv": 64 * 16}
    ss = state_space((8,), layers=2, page_size=16)
    assert ss.bytes_per_token()["state"] == 8 * 4 * 2 / 16


def test_page_size_must_be_multiple_of_every_ratio():
    with pytest.raises(ValueError, match="multiple of 128"):
        deepseek_v4_flash(page_size=200)
    with pytest.raises(ValueError, match="c4"):
        deepseek_v4_flash(page_size=130)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="x", ratio=None, retention=Retention.ALL, entry_shape=(1,), dtype="float32",
          layers=1), "ratio"),
    (dict(name="x", ratio=4, retention=Retention.CHECKPOINT, entry_shape=(1,), dtype="float32",
          layers=1), "ratio=None"),
    (dict(name="x", ratio=1, retention=Retention.WINDOW, entry_shape=(1,), dtype="float32",
          layers=1), "window"),
    (dict(name="x", ratio=1, retention=Retention.ALL, entry_shape=(1,), dtype="float32",
          layers=1, window=3), "only meaningful"),
    (dict(name="x", ratio=1, retention=Retention.ALL, entry_shape=(0,), dtype="float32",
          layers=1), "entry_shape"),
    (dict(name="x", ratio=1, retention=Retention.ALL, entry_shape=(1,), dtype="float64x",
          layers=1), "dtype"),
    (dict(name="", ratio=1, retention=Retention.ALL, entry_shape=(1,), dtype="float32",
          layers=1), "name"),
    (dict(name="x", ratio=1, retention=Retention.ALL, entry_shape=(1,), dtype="float32",
          layers=0), "layers"),
])
def test_invalid_pool_specs_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolSpec(**kwargs)


def test_invalid_layouts():
    spec = PoolSpec("kv", 1, Retention.ALL, (1,), "float32", 1)
    with pytest.raises(ValueError, match="unique"):
        KVLayout("x", (spec, spec), 4)
    with pytest.raises(ValueError, match="at least one pool"):
        KVLayout("x", (), 4)
    with pytest.raises(KeyError, match="no pool"):
        KVLayout("x", (spec,), 4).index("swa")


def test_window_pages():
    assert sliding_window(128, page_size=256).pool("swa").window_pages(256) == 1
    assert sliding_window(300, page_size=128).pool("swa").window_pages(128) == 3
    assert sliding_window(1, page_size=128).pool("swa").window_pages(128) == 0
    assert hybrid_swa(129, page_size=128).pool("swa").window_pages(128) == 1


def test_entry_index_is_derived_from_page_table():
    import numpy as np

    lay = deepseek_v4_flash(page_size=256)
    table = np.array([7, 3])
    pos = np.array([0, 3, 4, 255, 256, 300])
    assert lay.pool("c4").entry_index(table, pos, 256).tolist() == [
        7 * 64, 7 * 64, 7 * 64 + 1, 7 * 64 + 63, 3 * 64, 3 * 64 + 11]
    assert lay.pool("c128").entry_index(table, pos, 256).tolist() == [14, 14, 14, 15, 6, 6]
    assert lay.pool("state").entry_index(table, pos, 256).tolist() == [7, 7, 7, 7, 3, 3]


def test_fingerprint_changes_with_anything_that_changes_bytes():
    a = deepseek_v4_flash()
    assert a.fingerprint() == deepseek_v4_flash().fingerprint()
    assert a.fingerprint() != deepseek_v4_flash(page_size=512).fingerprint()
    assert a.fingerprint() != deepseek_v4_flash(dtype="float32").fingerprint()
    assert a.fingerprint() != deepseek_v4_pro().fingerprint()
