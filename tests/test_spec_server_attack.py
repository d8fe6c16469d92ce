"""Adversarial tests of speculative decoding on the server side and of MTP checkpoint
loading (`serve --speculative-algorithm ngram|mtp`, `load_mtp`, `Engine.from_pretrained`,
`fleet`). Each test states a claim; those that fail are defects (see the report).

The MTP checkpoint is one fresh `benchmarks/train_tiny.py --quick` run for the session
(conftest's `quick_checkpoint`), as train_tiny writes it (with its byte-level tokenizer)."""

from __future__ import annotations

import json
import random
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_util import SMALL_TINY, ServerThread, metrics
from transformers import DeepseekV4Config

from shadowradix.cli import main
from shadowradix.engine import CacheConfig, Engine, SpecConfig
from shadowradix.model.mtp import PREFIX, load_mtp, mtp_state_dict, random_mtp
from shadowradix.server.text_stream import TextStream
from shadowradix.server.tokenizer import tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0, "ignore_eos": True}
SPEC = "shadowradix:spec_decode_"


# ---------------------------------------------------------------- checkpoints
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def fresh_ckpt(quick_checkpoint, tmp_path_factory) -> Path:
    """train_tiny's checkpoint as `--quick --out DIR` writes it (with its byte tokenizer)."""
    out = tmp_path_factory.mktemp("ckpt") / "fresh"
    shutil.copytree(quick_checkpoint[0], out)
    return out


@pytest.fixture(scope="module")
def ckpt(request, tmp_path_factory) -> Path:
    """A fresh `--quick` checkpoint with train_tiny's byte tokenizer saved next to it, so
    `serve --model DIR` loads it."""
    from train_tiny import byte_tokenizer

    out = tmp_path_factory.mktemp("ckpt") / "served"
    shutil.copytree(request.getfixturevalue("fresh_ckpt"), out)  # the same on every machine
    byte_tokenizer().save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def hf_config(ckpt):
    return DeepseekV4Config.from_pretrained(str(ckpt))


def variant(ckpt: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(ckpt, d)
    return d


def edit_tensors(d: Path, fn: Any) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def shard(d: Path) -> None:
    """Rewrites a single-file checkpoint as an indexed one: the trunk in one shard, the
    MTP's tensors in model-mtp.safetensors (what save_mtp makes of a sharded checkpoint)."""
    t = load_file(str(d / "model.safetensors"))
    mtp = {k: v for k, v in t.items() if k.startswith(PREFIX)}
    rest = {k: v for k, v in t.items() if not k.startswith(PREFIX)}
    save_file(rest, str(d / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    save_file(mtp, str(d / "model-mtp.safetensors"), metadata={"format": "pt"})
    (d / "model.safetensors").unlink()
    weights = dict.fromkeys(rest, "model-00001-of-00001.safetensors")
    weights.update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weights}))


def engine_mtp(d: Path) -> Engine:
    return Engine.from_pretrained(str(d), CacheConfig(page_size=16, device_tokens=1024),
                                  speculative=SpecConfig("mtp", 3))


# ---------------------------------------------------------------- checkpoint defects
def test_a_train_tiny_checkpoint_serves_with_mtp(fresh_ckpt):
    """`train_tiny.py --out DIR` then `serve --model DIR --speculative-algorithm mtp`: the
    model loads (a checkpoint the project's own trainer wrote must be servable)."""
    with ServerThread.from_args("--model", str(fresh_ckpt), "--page-size", "16",
                                "--speculative-algorithm", "mtp") as srv:
        err = srv.runtime.loop.load_error
        assert err is None, f"the trainer's checkpoint does not serve: {err}"
        assert httpx.get(f"{srv.url}/health").status_code == 200


def test_layer_types_that_make_the_mtp_layer_compressed_are_refused(ckpt, tmp_path,
                                                                    hf_config):
    """config.json's `layer_types` with an entry for the MTP layer (index
    num_hidden_layers) that is compressed sparse attention (ratio 4) is the same checkpoint
    as `compress_ratios[n] = 4`, which is refused; transformers truncates layer_types to
    num_hidden_layers, so the trunk loads either way."""
    d = variant(ckpt, tmp_path, "csa")
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = [*cfg["layer_types"], "compressed_sparse_attention"]
    cfg["mlp_layer_types"] = [*cfg["mlp_layer_types"], "moe"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="compress"):
        load_mtp(d, hf_config)


def test_mtp_tensors_with_nan_are_refused(ckpt, tmp_path, hf_config):
    d = variant(ckpt, tmp_path, "nan")
    edit_tensors(d, lambda t: t[PREFIX + "e_proj.weight"].fill_(float("nan")))
    with pytest.raises(ValueError, match="(?i)nan|finite"):
        load_mtp(d, hf_config)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_mtp_tensors_of_a_wrong_dtype_are_refused(ckpt, tmp_path, hf_config, dtype):
    """An integer, boolean or FP8 tensor (FP8 without its scale) is not the weight: cast
    silently into float32 it is a different block."""
    d = variant(ckpt, tmp_path, "dtype")
    edit_tensors(d, lambda t: t.__setitem__(PREFIX + "e_proj.weight",
                                            (t[PREFIX + "e_proj.weight"] * 100).to(dtype)))
    with pytest.raises(ValueError, match="dtype"):
        load_mtp(d, hf_config)


def test_a_truncated_mtp_shard_is_a_one_line_load_error(ckpt, tmp_path):
    """A sharded checkpoint whose MTP shard is cut short: the server's load error is a
    ValueError (one log line naming the file), not a SafetensorError traceback."""
    d = variant(ckpt, tmp_path, "trunc")
    shard(d)
    p = d / "model-mtp.safetensors"
    p.write_bytes(p.read_bytes()[:p.stat().st_size // 2])
    with ServerThread.from_args("--model", str(d), "--page-size", "16",
                                "--speculative-algorithm", "mtp") as srv:
        err = srv.runtime.loop.load_error
        assert isinstance(err, ValueError), f"{type(err).__name__}: {err}"
        health = httpx.get(f"{srv.url}/health").json()
        assert "model-mtp.safetensors" in health["error"], health


def test_a_safetensors_file_the_checkpoint_does_not_name_is_not_read(ckpt, tmp_path,
                                                                     hf_config):
    """A stray *.safetensors file (not the checkpoint's model.safetensors, not in an
    index) does not stop the trunk from loading, so it must not stop the MTP either."""
    d = variant(ckpt, tmp_path, "stray")
    (d / "notes.safetensors").write_bytes(b"not a safetensors file")
    assert load_mtp(d, hf_config) is not None


def test_the_index_decides_which_file_holds_the_mtp_tensors(ckpt, tmp_path, hf_config):
    """An indexed checkpoint: its index maps mtp.0.* to model-mtp.safetensors; a leftover
    shard outside the index (an older block) must not replace them."""
    d = variant(ckpt, tmp_path, "index")
    shard(d)
    want = load_file(str(d / "model-mtp.safetensors"))
    save_file(mtp_state_dict(random_mtp(hf_config, seed=7)),
              str(d / "model-old.safetensors"), metadata={"format": "pt"})
    block = load_mtp(d, hf_config)
    got = mtp_state_dict(block)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        "the block came from a file the index does not name"


def test_fleet_refuses_mtp_on_the_tiny_model_before_starting(monkeypatch, capsys):
    """`fleet --model tiny --speculative-algorithm mtp`: every instance would refuse it
    (the tiny model has no MTP block), so the fleet refuses before any starts (exit 2,
    one line), as it does for the other combinations no instance takes."""
    import shadowradix.server.fleet as fleet

    class Started(Exception):
        pass

    def started(*_: object, **__: object) -> None:
        raise Started("the fleet started its instances")

    monkeypatch.setattr(fleet, "Fleet", started)
    try:
        rc = main(["fleet", "--model", "tiny", "--instances", "1",
                   "--speculative-algorithm", "mtp"])
    except Started:
        rc = "started"
    err = capsys.readouterr().err
    assert rc == 2, f"fleet: {rc}; {err}"
    assert "Traceback" not in err and "mtp" in err.strip().splitlines()[-1]


# ---------------------------------------------------------------- text stream property
def test_a_run_of_tokens_at_once_is_exactly_one_by_one_for_any_stops():
    """TextStream.add over random chunkings (a speculative step's run) equals feeding one
    token at a time: text, pieces joined, the stop matched and the tokens taken, for stop
    strings cut from the text itself (multi-byte UTF-8 ones, split across byte tokens,
    overlapping ones, several at once) and any min_tokens."""
    rng = random.Random(0)
    tiny = tiny_tokenizer(1024)

    class Bytes:  # one token per byte: every multi-byte character is split
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    samples = ["héllo wörld — ünïcödé ñ 日本語 héllo wörld — ünï",
               "abcabcabc aaa ababab ✓✓✓ x✓y ✓",
               "one two three two three four € € €€"]
    for trial in range(400):
        text = rng.choice(samples)
        tok, ids = ((Bytes(), list(text.encode())) if trial % 2 else
                    (tiny, tiny.encode(text, add_special_tokens=False)))
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 4)])
        min_tokens = rng.choice([0, 0, rng.randint(1, len(ids))])
        one = TextStream(tok, stops, min_tokens=min_tokens)
        pieces_one = [one.add([t]) for t in ids if one.stopped is None] + [one.finish()]
        run = TextStream(tok, stops, min_tokens=min_tokens)
        pieces_run, at = [], 0
        while at < len(ids) and run.stopped is None:
            n = rng.randint(1, 8)
            pieces_run.append(run.add(ids[at:at + n]))
            at += n
        pieces_run.append(run.finish())
        case = (text, stops, min_tokens)
        assert "".join(pieces_run) == "".join(pieces_one), case
        assert (run.stopped, run.ids) == (one.stopped, one.ids), case


# ---------------------------------------------------------------- HTTP on the MTP server
PROMPTS_SEED = 1


def copy_prompts(n: int, seed: int = PROMPTS_SEED) -> list[str]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from copy_edit import copy_edit_prompts

    return [bytes(p.prompt).decode() for p in copy_edit_prompts(n, seed)]


@pytest.fixture(scope="module")
def mtp_pair(ckpt):
    args = ("--model", str(ckpt), "--page-size", "16", "--device-tokens", "4096")
    with ServerThread.from_args(*args) as plain, ServerThread.from_args(
            *args, "--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "4"
    ) as spec:
        assert spec.runtime.loop.load_error is None, spec.runtime.loop.load_error
        yield plain, spec


def gen(server: ServerThread, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def engine_spec(server: ServerThread) -> dict[str, Any]:
    return server.on_engine(lambda e: dict(e.status()["spec"]))


def spec_metrics(server: ServerThread, k: int) -> dict[str, float]:
    m = metrics(server.url)
    out = {key: m[f"{SPEC}num_{key}_total"] for key in ("drafts", "draft_tokens",
                                                           "accepted_tokens")}
    out["per_pos"] = [m[f"{SPEC}num_accepted_tokens_per_pos_total{{position={i}}}"]
                      for i in range(k)]
    return out


def test_mtp_server_info_and_greedy_answers_streamed_and_whole(mtp_pair):
    plain, spec = mtp_pair
    info = httpx.get(f"{spec.url}/server_info").json()
    assert info["speculative_algorithm"] == "mtp"
    assert info["speculative_num_draft_tokens"] == 4
    assert info["speculative_ngram_min_match_window_size"] is None
    prompts = copy_prompts(4)
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 24, **GREEDY}}
    ref = gen(plain, body)
    before = engine_spec(spec)
    kw = dict(model=spec.runtime.model_name, prompt=prompts, max_tokens=24, temperature=0,
              ignore_eos=True)
    whole = httpx.post(f"{spec.url}/v1/completions", json=kw, timeout=300).json()
    texts = {c["index"]: c["text"] for c in whole["choices"]}
    assert [texts[i] for i in range(4)] == [r["text"] for r in ref]
    assert whole["usage"]["completion_tokens"] == 24 * 4
    pieces: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{spec.url}/v1/completions", timeout=300, json={
            **kw, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                for c in ev["choices"]:
                    pieces[c["index"]] = pieces.get(c["index"], "") + c["text"]
                usage = ev.get("usage") or usage
    assert [pieces[i] for i in range(4)] == [r["text"] for r in ref]
    assert usage["completion_tokens"] == 24 * 4
    after = engine_spec(spec)
    assert after["accepted_tokens"] > before["accepted_tokens"], "nothing was accepted"
    m = spec_metrics(spec, 4)
    assert m["accepted_tokens"] == after["accepted_tokens"]
    assert m["per_pos"] == after["accepted_per_position"]


def test_mtp_max_tokens_and_n_choices(mtp_pair):
    """max_tokens 1..5 and n = 3 sampled choices: no choice gets more, usage counts each."""
    _, spec = mtp_pair
    prompt = copy_prompts(1, 5)[0]
    with ThreadPoolExecutor(5) as pool:
        outs = list(pool.map(lambda m: httpx.post(f"{spec.url}/v1/completions", timeout=300,
                                                  json={"model": spec.runtime.model_name,
                                                        "prompt": prompt, "max_tokens": m,
                                                        "n": 3, "temperature": 0.7,
                                                        "seed": m, "ignore_eos": True}
                                                  ).json(), range(1, 6)))
    for m, out in zip(range(1, 6), outs, strict=True):
        assert out["usage"]["completion_tokens"] == 3 * m, out
        assert all(c["finish_reason"] == "length" for c in out["choices"])
        for c in out["choices"]:
            assert len(c["text"]) <= m  # byte tokens: at most one character each


def test_mtp_disconnects_mid_stream_leave_the_counters_exact(mtp_pair):
    """Clients that leave mid-stream while others run: the survivors' answers are the
    plain server's, and the metrics equal the engine's totals once it is idle."""
    plain, spec = mtp_pair
    prompts = copy_prompts(6, 11)
    body = lambda p: {"text": p, "sampling_params": {"max_new_tokens": 40, **GREEDY}}  # noqa: E731
    ref = [gen(plain, body(p))["output_ids"] for p in prompts[:3]]

    def leave(p: str) -> None:
        with httpx.stream("POST", f"{spec.url}/generate", json={**body(p), "stream": True},
                          timeout=300) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    return

    with ThreadPoolExecutor(6) as pool:
        stay = [pool.submit(gen, spec, body(p)) for p in prompts[:3]]
        gone = [pool.submit(leave, p) for p in prompts[3:]]
        for f in gone:
            f.result()
        assert [f.result()["output_ids"] for f in stay] == ref
    import time

    deadline = time.monotonic() + 20
    while spec.on_engine(lambda e: e.has_unfinished()) and time.monotonic() < deadline:
        time.sleep(0.05)
    httpx.get(f"{spec.url}/health")
    totals = engine_spec(spec)
    m = spec_metrics(spec, 4)
    assert (m["drafts"], m["draft_tokens"], m["accepted_tokens"], m["per_pos"]) == (
        totals["drafts"], totals["draft_tokens"], totals["accepted_tokens"],
        totals["accepted_per_position"])


def test_storage_is_not_shared_between_mtp_and_plain_servers_and_hits_draft_the_same(
        ckpt, tmp_path):
    """A plain server and an MTP server on one file:// store: different page layouts (the
    MTP adds a sliding-window layer), so the MTP server gets no storage hit from the plain
    one's pages; its own pages, read back by a fresh MTP server, draft exactly as cold
    (the drafter's KV is in the pages), and the answers are the plain server's."""
    store = f"file://{tmp_path / 'store'}"
    prompt = copy_prompts(1, 3)[0] * 2
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 30, **GREEDY}}
    base = ("--model", str(ckpt), "--page-size", "16", "--storage", store)
    spec_flags = ("--speculative-algorithm", "mtp", "--speculative-num-draft-tokens", "4")
    with ServerThread.from_args(*base) as plain:
        ref = gen(plain, body)
    with ServerThread.from_args(*base, *spec_flags) as spec:
        a = engine_spec(spec)
        cold = gen(spec, body)
        b = engine_spec(spec)
    assert cold["meta_info"]["cached_tokens_by_tier"]["storage"] == 0
    assert cold["output_ids"] == ref["output_ids"]
    with ServerThread.from_args(*base, *spec_flags) as spec:
        c = engine_spec(spec)
        warm = gen(spec, body)
        d = engine_spec(spec)
    assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] > 0
    assert warm["output_ids"] == ref["output_ids"]
    moved = lambda x, y: (y["drafts"] - x["drafts"], y["accepted_tokens"]  # noqa: E731
                          - x["accepted_tokens"])
    assert moved(c, d) == moved(a, b)


# ---------------------------------------------------------------- ngram server: limits
@pytest.mark.parametrize("extra", [  # the engine-level tests cover the rest
    ("--step-tokens", "1"), ("--device-tokens", "256", "--step-tokens", "64"),
    ("--hisparse-buffer", "64", "--host-tokens", "4096")])
def test_ngram_under_tight_limits_answers_as_the_plain_server(extra):
    prompts = ["abc abc abc abc abc abc", "1 2 3 1 2 3 1 2 3", "The cache keeps every form",
               "x y z x y z x y z x y"]
    body = lambda p: {"text": p, "sampling_params": {"max_new_tokens": 30, **GREEDY}}  # noqa: E731
    flags = [*SMALL_TINY, *extra]
    with ServerThread.from_args(*flags) as plain:
        ref = [gen(plain, body(p))["output_ids"] for p in prompts]
    with ServerThread.from_args(*flags, "--speculative-algorithm", "ngram",
                                "--speculative-num-draft-tokens", "7") as spec, \
            ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: gen(spec, body(p))["output_ids"], prompts))
    assert outs == ref


def test_ngram_under_max_queue_refuses_cleanly_and_the_rest_are_right():
    body = lambda p: {"text": p, "sampling_params": {"max_new_tokens": 30, **GREEDY}}  # noqa: E731
    prompts = ["abc abc abc abc abc abc"] * 4
    with ServerThread.from_args(*SMALL_TINY) as plain:
        ref = gen(plain, body(prompts[0]))["output_ids"]
    with ServerThread.from_args(*SMALL_TINY, "--max-queue", "1", "--speculative-algorithm",
                                "ngram") as spec:
        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(lambda p: httpx.post(f"{spec.url}/generate", json=body(p),
                                                    timeout=300), prompts))
        codes = sorted(r.status_code for r in rs)
        assert set(codes) <= {200, 503} and 200 in codes
        assert all(r.json()["output_ids"] == ref for r in rs if r.status_code == 200)
        assert gen(spec, body(prompts[0]))["output_ids"] == ref
