"""The simulator: bound equality, tiers, sizing, trace errors, the command line."""

import copy
import json

import numpy as np
import pytest

from shadowradix.cli import main
from shadowradix.layout import deepseek_v4_flash, deepseek_v4_pro, full_attention
from shadowradix.sim import TraceError, bundled_trace, load_trace, replay
from shadowradix.sim.simulate import (
    POLICY_NAMES,
    bound_hit_rate,
    make_cache,
    policy_choice,
    simulate,
)
from shadowradix.sim.sizing import GB, budget_bytes, pages_for_budget


@pytest.fixture(scope="module")
def simulated(conversation):
    """`simulate` over the conversation trace with each distinct (layout, policy choice,
    device GB, keywords) run once a module: several tests read the same run. Each call
    returns a copy of the record of its own."""
    runs: dict = {}

    def run(layout, choice, device_gb, **kw):  # type: ignore[no-untyped-def]
        key = (layout, choice, device_gb, tuple(sorted(kw.items())))
        if key not in runs:
            runs[key] = simulate(conversation, layout, choice, device_gb, **kw)
        return copy.deepcopy(runs[key])

    return run


@pytest.mark.parametrize("policy", ["shadowradix", "no-shadows"])
@pytest.mark.parametrize("trace", ["conversation", "synthetic"])
def test_unbounded_hit_rate_equals_the_bound_exactly(policy, trace, request):
    requests = request.getfixturevalue(trace)
    r = simulate(requests, deepseek_v4_flash(), policy_choice(policy), None)
    assert r["refused"] == 0
    assert r["hit_rate"] == r["bound_hit_rate"] > 0.1


def test_unbounded_full_attention_page_128_equals_the_bound(synthetic):
    r = simulate(synthetic, full_attention(page_size=128), policy_choice("shadowradix"), None)
    assert r["hit_rate"] == r["bound_hit_rate"] == bound_hit_rate(synthetic, 128)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_bounded_runs_stay_under_the_bound_and_tiers_sum(policy, simulated):
    r = simulated(deepseek_v4_pro(), policy_choice(policy, checkpoint_every=4), 20.0)
    assert 0 < r["hit_rate"] <= r["bound_hit_rate"]
    assert sum(r["cached_by_tier"].values()) == r["cached_tokens"]
    assert r["cached_tokens"] + r["computed_tokens"] == r["prompt_tokens"]
    assert r["pool_bytes"] <= 20 * GB
    assert all(r["peak_pages"][n] <= r["pool_pages"][n] for n in r["pool_pages"])


def test_shadows_beat_a_conventional_cache_at_equal_bytes(simulated):
    lay = deepseek_v4_flash()
    ours = simulated(lay, policy_choice("shadowradix"), 20.0)
    conventional = simulated(lay, policy_choice("no-shadows"), 20.0)
    assert ours["hit_rate"] > conventional["hit_rate"]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_chunked_replay_under_pressure_keeps_every_invariant(policy, synthetic):
    choice = policy_choice(policy, checkpoint_every=2)
    cache = make_cache(deepseek_v4_flash(), choice, 6 * GB)
    st = replay(cache, synthetic[:300], with_output=True, chunk_pages=8, check_every=25)
    assert st.requests == 300 and st.cached_tokens > 0
    assert sum(cache.evicted.values()) > 0  # the pressure was real
    cache.flush()
    assert all(p.used_pages == 0 for p in cache.pools.values())


def test_sizing_spends_the_budget_and_honours_the_window_ratio():
    lay = deepseek_v4_pro(dtype="fp8")
    pages = pages_for_budget(lay, 100 * GB, 0.1)
    assert pages["swa"] == int(pages["c4"] * 0.1)
    assert len({pages[n] for n in ("c4", "c4_index", "c128", "state")}) == 1
    used = budget_bytes(pages, lay)
    assert 0.99 * 100 * GB < used <= 100 * GB
    with pytest.raises(ValueError, match="window_ratio"):
        pages_for_budget(lay, GB, 0.0)


def test_trace_tokens_share_exactly_the_shared_blocks():
    a, b = load_trace(bundled_trace("conversation"), limit=2)
    ta, tb = a.prompt_tokens(), b.prompt_tokens()
    assert ta.size == a.input_length and tb.size == b.input_length
    shared = next(i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False))
                  if x != y)
    prefix = np.flatnonzero(ta[:tb.size] != tb[:ta.size])[0]
    assert prefix == shared * 512


def test_a_bad_trace_line_is_named(tmp_path):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
    for bad, why in [('{"timestamp": 1, "input_length": 10}', "output_length"),
                     ("not json", "not a trace request"),
                     ('{"timestamp": 1, "input_length": 600, "output_length": 1, '
                      '"hash_ids": [1]}', "expected 2"),
                     ('{"timestamp": 1, "input_length": 0, "output_length": 1, '
                      '"hash_ids": []}', "input_length must be")]:
        path = tmp_path / "t.jsonl"
        path.write_text(good + bad + "\n")
        with pytest.raises(TraceError, match=f"t.jsonl:2: .*{why}"):
            load_trace(path)


def test_cli_reports_bad_input_without_a_traceback(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("{}\n")
    assert main(["simulate", str(path)]) == 2
    assert "t.jsonl:1" in capsys.readouterr().err
    assert main(["simulate", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["simulate", str(bundled_trace()), "--model", "llama"]) == 2
    assert main(["simulate", str(bundled_trace()), "--sweep", "host-gb=1"]) == 2


def test_cli_simulate_sweep_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["simulate", str(bundled_trace("synthetic")), "--model", "deepseek-v4-pro",
               "--kv-dtype", "fp8", "--limit", "150", "--sweep", "device-gb=2,8",
               "--policy", "shadowradix,no-shadows", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    runs = json.loads(out.read_text())
    assert [(r["policy"], r["device_gb"]) for r in runs] == [
        ("shadowradix", 2.0), ("no-shadows", 2.0), ("shadowradix", 8.0), ("no-shadows", 8.0)]
    for key in ("requests", "prompt_tokens", "cached_tokens", "cached_by_tier", "hit_rate",
                "bound_hit_rate", "seconds", "peak_pages", "bytes_moved"):
        assert key in runs[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_with_host_and_storage_tiers(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", str(bundled_trace("conversation")), "--model", "deepseek-v4-flash",
               "--limit", "400", "--device-gb", "2", "--host-gb", "4", "--write-policy",
               "write_back", "--storage-gb", "inf", "--policy", "shadowradix",
               "--json", str(out)])
    assert rc == 0
    run = json.loads(out.read_text())
    assert (run["host_gb"], run["storage_gb"], run["write_policy"]) == (4.0, float("inf"),
                                                                       "write_back")
    assert run["cached_by_tier"]["host"] > 0 and run["cached_by_tier"]["storage"] > 0
    assert run["bytes_moved"]["device->host"] > 0 and run["bytes_moved"]["device->storage"] > 0
    printed = capsys.readouterr().out  # the tier columns render (their titles may wrap)
    assert "infinite-cache bound" in printed and "storage" in printed


@pytest.mark.parametrize("policy,write_policy", [("shadowradix", "write_through"),
                                                 ("no-shadows", "write_back"),
                                                 ("periodic", "write_through")])
def test_an_unbounded_host_loses_nothing_the_device_drops(policy, write_policy, simulated):
    """A small device over an unbounded host tier reaches the infinite-cache bound exactly:
    every page the device evicts was backed up (write-through) or spilled (write-back)
    and comes back."""
    lay = deepseek_v4_flash()
    alone = simulated(lay, policy_choice(policy), 8.0)
    tiered = simulated(lay, policy_choice(policy), 8.0, host_gb=1e4,
                      write_policy=write_policy)
    assert alone["hit_rate"] < 0.5 * alone["bound_hit_rate"]  # the device alone is too small
    assert tiered["refused"] == 0
    assert tiered["hit_rate"] == tiered["bound_hit_rate"]
    assert tiered["cached_by_tier"]["host"] > tiered["cached_by_tier"]["device"]
    assert tiered["bytes_moved"]["host->device"] > 0 and tiered["bytes_moved"]["device->host"] > 0


def test_a_bounded_host_helps_and_its_books_balance(simulated):
    lay = deepseek_v4_pro()
    alone = simulated(lay, policy_choice("shadowradix"), 20.0)
    tiered = simulated(lay, policy_choice("shadowradix"), 20.0, host_gb=60.0)
    assert alone["hit_rate"] < tiered["hit_rate"] <= tiered["bound_hit_rate"]
    assert sum(tiered["cached_by_tier"].values()) == tiered["cached_tokens"]
    assert tiered["bytes_moved"]["host->device"] > 0 and tiered["host_gb"] == 60.0


@pytest.mark.parametrize("host_gb", [0.0, 4.0])
def test_an_unbounded_store_brings_back_everything(host_gb, simulated):
    """Write-through to an unbounded L3 and a small device (with or without a host tier
    smaller than the device): a request reads back from storage what the tiers above
    lost, so the hit rate is the infinite-cache bound exactly."""
    r = simulated(deepseek_v4_flash(), policy_choice("shadowradix"), 8.0,
                 host_gb=host_gb, storage_gb=float("inf"))
    assert r["refused"] == 0
    assert r["hit_rate"] == r["bound_hit_rate"]
    assert r["cached_by_tier"]["storage"] > r["cached_by_tier"]["device"]
    assert sum(r["cached_by_tier"].values()) == r["cached_tokens"]
    moved = r["bytes_moved"]
    assert moved["device->storage"] > 0 and moved["storage->host"] + moved["storage->device"] > 0


def test_a_capped_store_evicts_and_helps_less(simulated):
    lay = deepseek_v4_flash()
    small = simulated(lay, policy_choice("shadowradix"), 8.0, storage_gb=20.0)
    big = simulated(lay, policy_choice("shadowradix"), 8.0, storage_gb=2000.0)
    alone = simulated(lay, policy_choice("shadowradix"), 8.0)
    assert alone["hit_rate"] <= small["hit_rate"] < big["hit_rate"] <= big["bound_hit_rate"]


# ------------------------------------------------- hostile traces (found by an attack)

def _trace_line(**kw) -> str:
    d = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    d.update(kw)
    return json.dumps(d) + "\n"


def test_a_request_past_int32_token_ids_is_a_trace_error(tmp_path, capsys):
    """output_length 1e11 (no sequence chain): the replay made up that many output tokens
    in one int32 array (373 GiB) and died with numpy's MemoryError."""
    p = tmp_path / "t.jsonl"
    p.write_text(_trace_line(output_length=100_000_000_000))
    assert main(["simulate", str(p), "--device-gb", "1", "--policy", "shadowradix"]) == 2
    assert "input_length + output_length" in capsys.readouterr().err


def test_a_short_prompt_in_a_huge_block_expands_only_its_tokens(tmp_path):
    """A 5-token prompt in one block of 2**30 tokens: the replay expanded whole blocks (and
    kept a buffer twice that: about 12 GB for 5 tokens). Under a 2 GiB address-space
    limit it died with a MemoryError traceback."""
    import resource
    import subprocess
    import sys

    p = tmp_path / "t.jsonl"
    p.write_text(_trace_line(input_length=5, output_length=3, block_size=1 << 30))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-m", "shadowradix", "simulate", str(p),
                        "--device-gb", "1", "--policy", "shadowradix"], capture_output=True,
                       text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-600:]
    req = load_trace(str(p))[0]
    assert req.expanded_tokens == 5
    assert req.sequence_hash_ids is None and req.prompt_tokens().tolist() == list(range(5))


def test_made_up_output_tokens_stay_int32_past_two_to_the_31():
    """Output tokens are numbered from 2**30 up in int32: past 2**31 they wrapped to negative
    ids silently. They now start again at 2**30 (a later prompt never reads an output)."""
    from shadowradix.sim.replay import _Tokens
    from shadowradix.sim.trace import TraceRequest

    tokens = _Tokens(with_output=True)
    tokens.next_output = 2**31 - 2
    _, seq = tokens(TraceRequest(0, 4, 4, (0,), block_size=4))
    assert seq[4:].tolist() == [2**30 + i for i in range(4)]


def test_a_storage_size_whose_bytes_overflow_is_unbounded_as_inf_is(tmp_path):
    """--storage-gb inf was unbounded but 1e300 (bytes past a float) failed with 'cannot
    convert float NaN to integer'."""
    trace = str(bundled_trace("conversation"))
    runs = []
    for size in ("inf", "1e300"):
        out = tmp_path / f"{size}.json"
        assert main(["simulate", trace, "--limit", "20", "--policy", "shadowradix",
                     "--device-gb", "1", "--storage-gb", size, "--json", str(out)]) == 0
        run = json.loads(out.read_text())
        runs.append({k: v for k, v in run.items() if k not in ("storage_gb", "seconds")})
    assert runs[0] == runs[1]


def test_trace_synth_refuses_a_max_context_no_trace_request_can_hold(tmp_path, capsys):
    """--max-context 1e12 with a 1e11-token system prompt allocated 745 GiB."""
    with pytest.raises(SystemExit) as e:
        main(["trace", "synth", "--conversations", "2", "--max-context", "1000000000000",
              "--system-tokens", "1e11,0", "-o", str(tmp_path / "s.jsonl")])
    assert e.value.code == 2
    assert "--max-context" in capsys.readouterr().err


def test_a_trace_too_large_for_memory_is_an_error_line_not_a_traceback(tmp_path):
    """Within every bound (--max-context 2**30, block size 1) a 500M-token system prompt
    still needs gigabytes: under a 3 GiB address-space limit `trace synth` died with
    numpy's MemoryError traceback. It is now one error line, exit 1."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    r = subprocess.run([sys.executable, "-m", "shadowradix", "trace", "synth",
                        "--conversations", "1", "--turns-min", "1", "--turns-max", "1",
                        "--max-context", str(1 << 30), "--system-tokens", "500000000,0",
                        "--prompt-tokens", "10,0", "--reply-tokens", "10,0",
                        "--block-size", "1", "-o", str(tmp_path / "s.jsonl")],
                       capture_output=True, text=True, preexec_fn=limit, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-400:]
    assert "out of memory" in r.stderr.strip().splitlines()[-1]
