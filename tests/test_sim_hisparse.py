"""HiSparse capacity planning: the device bytes of one decoding request, off and on, by
hand, against the manager that really holds the pages, and through the CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from shadowradix.cli import main
from shadowradix.layout.presets import CSA, HCA, SWA, deepseek_v4, deepseek_v4_pro, full_attention
from shadowradix.sim.hisparse import (
    decode_footprint,
    decode_pages,
    hisparse_rows,
    index_topk_of,
    parse_contexts,
)
from shadowradix.sim.sizing import GB
from shadowradix.sim.trace import bundled_trace
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager

PS = 16


def tiny(window: int = 8):
    """model/tiny.py's shape: SWA, CSA, HCA, CSA; head 32, indexer 16, C128 ratio 16."""
    cfg = SimpleNamespace(layer_types=[SWA, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16},
                          head_dim=32, index_head_dim=16, sliding_window=window)
    return deepseek_v4(cfg, page_size=PS, dtype="float32")


def test_tiny_layout_by_hand():
    """T = 100 tokens in pages of 16: 7 pages touched, 6 whole. Window 8 -> 1 page
    before a resume point, so hold = 1."""
    lay = tiny()
    assert decode_pages(lay, 100) == {"swa": 2, "c4": 7, "c4_index": 7, "c128": 7, "state": 2}
    off = decode_footprint(lay, 100)
    swa = 2 * 16 * (32 * 4) * 4  # 2 pages, 16 entries, 32 float32, 4 layers
    c4 = 7 * 4 * (32 * 4) * 2  # 7 pages, 16 / 4 entries, 2 CSA layers
    index = 7 * 4 * (16 * 4) * 2
    c128 = 7 * 1 * (32 * 4) * 1  # 16 / 16 entries, 1 HCA layer
    state = 2 * 1 * (2 * 4 * 48 * 4) * 2  # one [2, 4, 32 + 16] state per page
    assert off.device == {"swa": swa, "c4": c4, "c4_index": index, "c128": c128,
                          "state": state}
    assert off.device_bytes == 34176 and off.host == {}
    on = decode_footprint(lay, 100, 5, index_topk=4)
    assert on.device["c4"] == 5 * (32 * 4) * 2  # the hot buffer: 5 entries, 2 layers
    assert on.host == {"c4": c4}
    assert on.device_bytes == 34176 - c4 + 1280
    assert off.requests_per_gb() == GB // 34176 and on.requests_per_gb(2) == 2 * GB // 28288


def test_deepseek_v4_pro_fp8_by_hand():
    """128K tokens in pages of 256: 512 pages. SGLang's fp8 records: 584 B per KV entry,
    132 B per indexer key; state [2, 4, 512 + 128] float32. 61 layers, 30 CSA, 31 HCA;
    window 128 -> 1 page, hold 1."""
    lay = deepseek_v4_pro(256, "fp8")
    p = {s.name: s for s in lay.pools}
    assert [(p[n].entry_bytes, p[n].layers) for n in p] == [
        (584, 61), (584, 30), (132, 30), (584, 31), (2 * 4 * 640 * 4, 30)]
    t = 131072
    off = decode_footprint(lay, t)
    want = {"swa": 2 * 256 * 584 * 61, "c4": 512 * 64 * 584 * 30,
            "c4_index": 512 * 64 * 132 * 30, "c128": 512 * 2 * 584 * 31,
            "state": 2 * 20480 * 30}
    assert off.device == want
    assert off.device_bytes == 741_863_424
    on = decode_footprint(lay, t, 2048, index_topk=1024)
    assert on.device["c4"] == 2048 * 584 * 30 and on.host == {"c4": want["c4"]}
    assert on.device_bytes == 741_863_424 - want["c4"] + 35_880_960 == 203_649_024
    assert (off.requests_per_gb(), on.requests_per_gb()) == (1, 5)
    row, = hisparse_rows(lay, [t], 2048, 1024)
    assert row["ratio"] == pytest.approx(741_863_424 / 203_649_024)


@pytest.mark.parametrize("window", [8, 40])  # hold 1, and a window over 3 pages
def test_pages_match_a_decoding_manager(window):
    """Drive the engine's CacheManager: prefill 40 tokens, then decode one token a step.
    What it pins (used minus evictable) equals decode_pages for the ALL and WINDOW pools
    and never exceeds it for the state pool (reached at each page end); peak_pages, the
    admission bound, is never below."""
    lay = tiny(window)
    cache = PrefixCache(lay, 200)
    manager = CacheManager(cache)
    seq = np.arange(150, dtype=np.int32)
    lease = manager.admit(seq, chunk=40, length=seq.size)
    assert lease is not None and manager.grow(lease, 40)
    manager.cache_prefix(lease, seq, 40)
    for end in range(41, seq.size + 1):
        assert manager.grow(lease, end)
        pinned = {n: cache.pools[n].used_pages - cache.tree.evictable(n) for n in lay.pool_names}
        want = decode_pages(lay, end)
        assert {n: pinned[n] for n in want if n != "state"} == {
            n: want[n] for n in want if n != "state"}, end
        assert pinned["state"] <= want["state"]
        if end % PS == 0:
            assert pinned["state"] == want["state"], end
        assert all(want[n] <= k for n, k in manager.peak_pages(end, 1).items())
        manager.cache_prefix(lease, seq, end)
    manager.finish(lease, seq, seq.size)


@pytest.mark.parametrize("lay,buffer,topk", [
    (deepseek_v4_pro(256, "fp8"), 2048, 1024),
    (deepseek_v4_pro(256), 1025, 1024),
    (tiny(), 5, 4),
])
def test_on_beats_off_at_long_context(lay, buffer, topk):
    for t in (131072, 1 << 20):
        off, on = decode_footprint(lay, t), decode_footprint(lay, t, buffer, index_topk=topk)
        assert on.device_bytes < off.device_bytes
        assert on.requests_per_gb(1000) > off.requests_per_gb(1000)
        assert on.host_bytes == off.device["c4"]


@pytest.mark.parametrize("lay,buffer,topk", [
    (deepseek_v4_pro(256, "fp8"), 2048, 1024), (tiny(), 5, 4), (tiny(), 12, 4)])
def test_a_history_shorter_than_the_buffer_is_not_a_saving(lay, buffer, topk):
    """While the C4 history (ceil(T / 4) entries) fits the buffer, the buffer is larger
    than the history: on saves at most the unwritten tail of the last C4 page (held whole
    when off), and costs more whenever the pages it replaces hold <= buffer entries."""
    c4 = lay.pool("c4")
    epp = c4.entries_per_page(lay.page_size)
    per_entry = c4.entry_bytes * c4.layers
    for t in range(1, 4 * buffer + 1, max(1, buffer // 7)):
        off, on = decode_footprint(lay, t), decode_footprint(lay, t, buffer, index_topk=topk)
        held = math.ceil(t / lay.page_size) * epp  # c4 entries off holds on the device
        tail = held - math.ceil(t / 4)
        assert off.device_bytes - on.device_bytes <= tail * per_entry, t
        if held <= buffer:
            assert on.device_bytes >= off.device_bytes, t
            assert on.requests_per_gb() <= off.requests_per_gb(), t
    # tiny, buffer 5, T = 20: history 5 entries, but off holds 2 pages = 8 entries.
    if buffer == 5:
        gap = decode_footprint(lay, 20).device_bytes - decode_footprint(
            lay, 20, 5, index_topk=4).device_bytes
        assert gap == 3 * per_entry


def test_bad_inputs_raise_naming_the_argument():
    lay = tiny()
    for t in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="context"):
            decode_footprint(lay, t)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer must be an int >= index_topk \\+ 1 = 5"):
        decode_footprint(lay, 100, 4, index_topk=4)
    with pytest.raises(ValueError, match="buffer"):
        decode_footprint(lay, 100, 5.0, index_topk=4)  # type: ignore[arg-type]
    for k in (None, 0, True):
        with pytest.raises(ValueError, match="index_topk"):
            decode_footprint(lay, 100, 5, index_topk=k)
    with pytest.raises(ValueError, match="no 'c4' pool"):
        decode_footprint(full_attention(page_size=16), 100, 5, index_topk=4)
    with pytest.raises(ValueError, match="multiple"):
        decode_footprint(lay, 100, page_size=6)
    with pytest.raises(ValueError, match="--context"):
        parse_contexts("16384,lots")
    with pytest.raises(ValueError, match="context"):
        parse_contexts("0")
    with pytest.raises(ValueError, match="compressed sparse attention"):
        index_topk_of("full-attention")
    assert (index_topk_of("deepseek-v4-flash"), index_topk_of("deepseek-v4-pro")) == (512, 1024)


def test_page_size_recuts_the_layout():
    lay = tiny()
    assert decode_footprint(lay, 100, page_size=32) == decode_footprint(
        lay.with_page_size(32), 100)


def test_cli_prints_and_writes_the_hisparse_figures(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", str(bundled_trace("conversation")), "--limit", "50",
               "--model", "deepseek-v4-pro", "--kv-dtype", "fp8", "--policy", "shadowradix",
               "--hisparse-buffer", "2048", "--context", "4096,131072", "--json", str(out)])
    assert rc == 0
    hs = json.loads(out.read_text())["hisparse"]
    assert (hs["buffer"], hs["index_topk"], hs["page_size"]) == (2048, 1024, 256)
    assert [r["context"] for r in hs["rows"]] == [4096, 131072]
    short, long = hs["rows"]
    assert long["device_bytes_on"] == 203_649_024 and long["requests_per_gb_on"] == 5
    assert short["ratio"] < 1 < long["ratio"]
    assert "HiSparse buffer 2,048" in capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--hisparse-buffer", "1024"],
                                   ["--hisparse-buffer", "9", "--model", "full-attention"],
                                   ["--hisparse-buffer", "2048", "--context", "0"]])
def test_cli_rejects_bad_hisparse_flags(extra, capsys):
    rc = main(["simulate", str(bundled_trace("conversation")), "--limit", "5",
               "--model", "deepseek-v4-pro", "--policy", "shadowradix", *extra])
    assert rc == 2 and "shadowradix: error:" in capsys.readouterr().err
