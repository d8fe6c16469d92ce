"""The server with speculative decoding (`--speculative-algorithm ngram`): a real uvicorn
on 127.0.0.1, the official `openai` client and SGLang's `/generate`. One engine step can
release several tokens (the accepted drafts and the model's own); nothing a client sees
may depend on that: greedy answers equal the server's without speculation, streams join
into the whole text, a stop string inside a multi-token run cuts exactly there (and the
tokens after it are not counted), max_tokens holds, and the spec_decode counters move by
what the engine did."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from server_util import SMALL_TINY, ServerThread, metrics, serve_args

from shadowradix.cli import main
from shadowradix.engine import Engine, SpecConfig
from shadowradix.server.serve import runtime_from_args, spec_config
from shadowradix.server.text_stream import TextStream
from shadowradix.server.tokenizer import tiny_tokenizer

K = 7
N = 16  # tokens per answer: the "abc" prompt's drafts are accepted from its 6th token on
# Repetitive prompts (prompt lookup finds drafts the tiny model agrees with) and one that
# is not (drafts, if any, are rejected: the answer must not change either way).
PROMPTS = ["abc abc abc abc abc abc", "1 2 3 1 2 3 1 2 3", "The cache keeps every form"]
GREEDY = {"temperature": 0, "ignore_eos": True}
SPEC = "shadowradix:spec_decode_"
COUNTERS = {"drafts": f"{SPEC}num_drafts_total",
            "draft_tokens": f"{SPEC}num_draft_tokens_total",
            "accepted_tokens": f"{SPEC}num_accepted_tokens_total"}


@pytest.fixture(scope="module")
def spec():
    with ServerThread.from_args(*SMALL_TINY, "--speculative-algorithm", "ngram",
                                "--speculative-num-draft-tokens", str(K)) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain():
    with ServerThread.from_args(*SMALL_TINY) as srv:
        yield srv


def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def generate(server: ServerThread, body: dict[str, Any]) -> Any:
    r = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def generate_steps(server: ServerThread, body: dict[str, Any]) -> dict[int, list[list[int]]]:
    """A streamed /generate: per prompt index, the tokens each event (one engine step) added."""
    steps: dict[int, list[list[int]]] = {}
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True},
                      timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                mine = steps.setdefault(event["index"], [])
                mine.append(event["output_ids"][sum(map(len, mine)):])
    return steps


def spec_totals(server: ServerThread) -> dict[str, Any]:
    """The engine's own speculative counters (read on its thread, between steps)."""
    return server.on_engine(lambda e: e.status()["spec"])


def spec_metrics(server: ServerThread) -> dict[str, float]:
    m = metrics(server.url)
    out = {key: m[name] for key, name in COUNTERS.items()}
    for i in range(K):
        out[f"pos{i}"] = m[f"{SPEC}num_accepted_tokens_per_pos_total{{position={i}}}"]
    return out


def as_metrics(totals: dict[str, Any]) -> dict[str, float]:
    out = {key: float(totals[key]) for key in COUNTERS}
    out.update({f"pos{i}": float(n) for i, n in enumerate(totals["accepted_per_position"])})
    return out


@dataclass
class Answers:
    """The same greedy requests, several ways, from both servers."""

    base: list[dict[str, Any]]  # /generate on the server without speculation
    whole: Any  # openai completion (a batch of PROMPTS), speculative server
    chunks: list[Any]  # the same, streamed
    steps: dict[int, list[list[int]]]  # streamed /generate: tokens per step, per prompt
    before: dict[str, float]  # the spec counters around it all
    after: dict[str, float]
    engine_before: dict[str, Any]
    engine_after: dict[str, Any]


@pytest.fixture(scope="module")
def answers(spec, plain) -> Answers:
    base = generate(plain, {"text": PROMPTS, "sampling_params": {"max_new_tokens": N,
                                                                 **GREEDY}})
    engine_before, before = spec_totals(spec), spec_metrics(spec)
    kw = dict(model="tiny", prompt=PROMPTS, max_tokens=N, temperature=0,
              extra_body={"ignore_eos": True})
    c = client(spec)
    with ThreadPoolExecutor(3) as pool:  # at once: one batch on the engine, a third the time
        whole = pool.submit(c.completions.create, **kw)
        chunks = pool.submit(lambda: list(c.completions.create(
            **kw, stream=True, stream_options={"include_usage": True})))
        steps = pool.submit(generate_steps, spec, {"text": PROMPTS, "sampling_params": {
            "max_new_tokens": N, **GREEDY}})
        answers = whole.result(), chunks.result(), steps.result()
    engine_after = spec_totals(spec)
    return Answers(base, *answers, before, spec_metrics(spec), engine_before, engine_after)


def runs(answers: Answers) -> list[tuple[int, int, int]]:
    """(prompt, first token, length) of every step that released more than one token."""
    out = []
    for p, steps in answers.steps.items():
        at = 0
        for step in steps:
            if len(step) > 1:
                out.append((p, at, len(step)))
            at += len(step)
    return out


# ---------------------------------------------------------------- same answers
def test_greedy_answers_equal_the_server_without_speculation(answers):
    assert runs(answers), "no step released several tokens: nothing was tested"
    texts = [c.text for c in sorted(answers.whole.choices, key=lambda c: c.index)]
    assert texts == [b["text"] for b in answers.base]
    for p, b in enumerate(answers.base):
        assert [t for step in answers.steps[p] for t in step] == b["output_ids"]
        assert len(b["output_ids"]) == N
    assert all(c.finish_reason == "length" for c in answers.whole.choices)
    assert answers.whole.usage.completion_tokens == N * len(PROMPTS)


def test_stream_joins_to_the_whole_text_and_counts_every_token(answers):
    pieces: dict[int, list[str]] = {}
    finals: dict[int, list[str | None]] = {}
    for chunk in answers.chunks:
        for c in chunk.choices:
            pieces.setdefault(c.index, []).append(c.text)
            finals.setdefault(c.index, []).append(c.finish_reason)
    for c in answers.whole.choices:
        assert "".join(pieces[c.index]) == c.text
        assert finals[c.index][-1] == "length" and not any(finals[c.index][:-1])
    usage = answers.chunks[-1].usage
    assert answers.chunks[-1].choices == []
    assert usage.completion_tokens == N * len(PROMPTS) == answers.whole.usage.completion_tokens


def test_drafts_were_accepted_and_the_metrics_say_exactly_so(spec, answers):
    """The counters moved by what the engine counted, per position too, and are its
    totals (a fresh server: both started at zero)."""
    moved = {k: answers.after[k] - answers.before[k] for k in answers.after}
    engine = {k: as_metrics(answers.engine_after)[k] - as_metrics(answers.engine_before)[k]
              for k in moved}
    assert moved == engine
    assert moved["accepted_tokens"] > 0 and moved["drafts"] > 0
    assert moved["draft_tokens"] >= moved["accepted_tokens"]
    assert sum(moved[f"pos{i}"] for i in range(K)) == moved["accepted_tokens"]
    # Each step of n > 1 tokens kept n - 1 drafts (the last token is the model's own).
    assert moved["accepted_tokens"] >= sum(n - 1 for _, _, n in runs(answers))
    assert answers.after == as_metrics(answers.engine_after)
    assert spec_totals(spec)["accepted_tokens"] == answers.engine_after["accepted_tokens"]


# ---------------------------------------------------------------- cuts inside a run
def stop_inside_a_run(answers: Answers, tok: Any) -> tuple[int, int, str]:
    """(prompt, j, stop): a stop string whose first occurrence completes at output token j,
    which a step released together with tokens after it (the earliest such token). Runs
    repeat earlier text (that is why the drafts were right), so the stop is the shortest
    end of the text up to token j that occurs nowhere before."""
    found = []
    for p, start, n in runs(answers):
        ids, full = answers.base[p]["output_ids"], answers.base[p]["text"]
        for j in range(start, start + n - 1):  # never the run's last token
            before = tok.decode(ids[:j], skip_special_tokens=True)
            upto = tok.decode(ids[:j + 1], skip_special_tokens=True)
            if len(upto) <= len(before) or upto.endswith("\ufffd") or \
                    not full.startswith(upto):
                continue  # token j adds no settled text
            for size in range(1, len(upto)):
                stop = upto[-size:]
                if full.find(stop) == len(upto) - size:
                    found.append((j, p, stop))
                    break
    assert found, f"no stop string fits inside a run: {runs(answers)}"
    j, p, stop = min(found)
    return p, j, stop


def test_a_stop_string_inside_a_run_cuts_there(spec, plain, answers):
    """The text ends right before the stop string, and the answer has j + 1 tokens (the
    one that completed it is the last), whole, streamed and on /generate alike, as on the
    server without speculation; the tokens the step released after it are not counted."""
    p, j, stop = stop_inside_a_run(answers, spec.runtime.tokenizer)
    full = answers.base[p]["text"]
    want = full[:full.index(stop)]
    kw = dict(model="tiny", prompt=PROMPTS[p], max_tokens=N, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    sp = {"max_new_tokens": N, "stop": [stop], **GREEDY}
    with ThreadPoolExecutor(4) as pool:
        whole = pool.submit(client(spec).completions.create, **kw)
        chunks = pool.submit(lambda: list(client(spec).completions.create(
            **kw, stream=True, stream_options={"include_usage": True})))
        gen = pool.submit(generate, spec, {"text": PROMPTS[p], "sampling_params": sp})
        ref = pool.submit(client(plain).completions.create, **kw)
        whole, chunks, gen, ref = (f.result() for f in (whole, chunks, gen, ref))
    assert whole.choices[0].text == want and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == j + 1 == ref.usage.completion_tokens
    assert ref.choices[0].text == want
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == j + 1
    assert gen["output_ids"] == answers.base[p]["output_ids"][:j + 1]
    assert gen["meta_info"]["completion_tokens"] == j + 1
    assert gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@dataclass
class Loop:
    """A prompt that ends inside the model's loop (a prompt and the start of its answer,
    up to its longest run): the drafts, copied from the prompt, are accepted at once."""

    prompt: list[int]
    ref: list[int]  # the server without speculation's answer
    steps: list[list[int]]  # the speculative server's, per step


@pytest.fixture(scope="module")
def loop(spec, plain, answers) -> Loop:
    p, start, _ = max(runs(answers), key=lambda r: r[2])
    prompt = spec.runtime.tokenizer.encode(PROMPTS[p]) + answers.base[p]["output_ids"][:start]
    ref = generate(plain, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                                                                    **GREEDY}})
    steps = generate_steps(spec, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, **GREEDY}})[0]
    assert [t for step in steps for t in step] == ref["output_ids"]
    assert max(map(len, steps)) > 2, f"the drafts were not accepted: {steps}"
    return Loop(prompt, ref["output_ids"], steps)


def test_max_tokens_is_never_exceeded(spec, loop):
    """With K = 7 and drafts that are accepted at once, an answer of max_tokens m has
    exactly m tokens, the first m of the answer without speculation."""
    limits = (1, 2, 3, 4)
    with ThreadPoolExecutor(len(limits)) as pool:
        outs = list(pool.map(lambda m: generate(spec, {"input_ids": loop.prompt,
                                                       "sampling_params": {
                                                           "max_new_tokens": m, **GREEDY}}),
                             limits))
    for m, out in zip(limits, outs, strict=True):
        assert out["output_ids"] == loop.ref[:m]
        assert out["meta_info"]["completion_tokens"] == m
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": m}
    out = client(spec).completions.create(model="tiny", prompt=loop.prompt, max_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_a_stop_token_inside_a_run_ends_there(spec, loop):
    """A stop token id a step drafted with tokens after it: the answer ends at it (the
    last of output_ids, counted, not in the text)."""
    at, cuts = 0, []
    for step in loop.steps:
        cuts += [j for j in range(at, at + len(step) - 1) if loop.ref[j] not in loop.ref[:j]]
        at += len(step)
    assert cuts, f"no drafted token is new: {loop.steps}"
    j = cuts[0]
    gen = generate(spec, {"input_ids": loop.prompt, "sampling_params": {
        "max_new_tokens": 6, "stop_token_ids": [loop.ref[j]], **GREEDY}})
    assert gen["output_ids"] == loop.ref[:j + 1]
    assert gen["meta_info"]["finish_reason"] == {"type": "stop", "matched": loop.ref[j]}
    assert gen["text"] == spec.runtime.tokenizer.decode(loop.ref[:j], skip_special_tokens=True)


# ---------------------------------------------------------------- text stream
def test_several_tokens_at_once_are_taken_as_one_by_one():
    """TextStream.add with a whole run: the same text, the same stop, the same tokens
    taken (not those after the one that completed the stop) as fed one at a time; with
    min_tokens too (the first "two" is too early to count there)."""
    tok = tiny_tokenizer(1024)
    ids = tok.encode("one two three two three four", add_special_tokens=False)
    late = len(tok.encode("one two", add_special_tokens=False)) + 1
    for stop, min_tokens in (("two", 0), ("two", late), ("ee t", 0)):
        one = TextStream(tok, [stop], min_tokens=min_tokens)
        text = "".join(one.add([t]) for t in ids if one.stopped is None) + one.finish()
        run = TextStream(tok, [stop], min_tokens=min_tokens)
        assert run.add(ids) + run.finish() == text
        assert (run.stopped, run.ids) == (one.stopped, one.ids) and one.stopped == stop
        assert len(run.ids) < len(ids)


# ---------------------------------------------------------------- settings, flags
def test_server_info_shows_the_speculative_settings(spec, plain):
    got = httpx.get(f"{spec.url}/server_info").json()
    assert {k: v for k, v in got.items() if k.startswith("speculative_")} == {
        "speculative_algorithm": "ngram", "speculative_num_draft_tokens": K,
        "speculative_ngram_min_match_window_size": 1,
        "speculative_ngram_max_match_window_size": 3}
    off = httpx.get(f"{plain.url}/server_info").json()
    assert off["speculative_algorithm"] is None and off["speculative_num_draft_tokens"] is None
    assert not any(k.startswith(SPEC) for k in metrics(plain.url))


def test_the_flags_become_the_engines_spec_config():
    assert spec_config(serve_args("--model", "tiny")) is None
    assert spec_config(serve_args("--model", "tiny", "--speculative-algorithm", "NGRAM",
                                  "--speculative-num-draft-tokens", "5",
                                  "--speculative-ngram-min-match-window-size", "2",
                                  "--speculative-ngram-max-match-window-size", "4")
                       ) == SpecConfig("ngram", 5, ngram_min=2, ngram_max=4)
    with pytest.raises(ValueError, match="--model tiny has none"):  # NEXTN is mtp
        spec_config(serve_args("--model", "tiny", "--speculative-algorithm", "NEXTN"))


def test_mtp_goes_to_the_engine_and_its_refusal_is_the_load_error(monkeypatch):
    """The engine decides whether the model has an MTP block; its ValueError is what
    /health reports (the server stays up, as for any model that fails to load)."""
    given: list[Any] = []

    def refuse(hf: Any, config: Any, **kw: Any) -> Engine:
        given.append(kw.get("speculative"))
        raise ValueError("this model has no MTP block")

    import shadowradix.server.serve as serve_module

    monkeypatch.setattr(serve_module, "_check_mtp_model", lambda model: None)
    monkeypatch.setattr(Engine, "from_hf", refuse)
    args = ("--model", "tiny", "--speculative-algorithm", "mtp",
            "--speculative-num-draft-tokens", "2")
    with ServerThread(runtime_from_args(serve_args(*args))) as srv:
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and r.json() == {"status": "failed",
                                                     "error": "this model has no MTP block"}
    assert given == [SpecConfig("mtp", 2)]


def cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """`shadowradix ARGV` must exit 2 with one error line (after argparse's usage)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("shadowradix") and "error:" in line, err
    return line


@pytest.fixture
def no_start(monkeypatch):
    """serve checks its flags as it does before anything starts (runtime_from_args), then
    fails the test instead of starting; fleet fails at once: a flag the checks let through
    would otherwise start a server (or a fleet)."""
    import shadowradix.server.fleet
    import shadowradix.server.serve

    def serve(args: Any) -> int:
        runtime_from_args(args)
        raise AssertionError("the server started: its flags passed the checks")

    def started(*_: object) -> int:
        raise AssertionError("the fleet started: its flags passed the parser")

    monkeypatch.setattr(shadowradix.server.serve, "serve", serve)
    monkeypatch.setattr(shadowradix.server.fleet, "run_fleet", started)


@pytest.mark.parametrize("command", ["serve", "fleet"])
@pytest.mark.parametrize("flag, value", [
    ("--speculative-algorithm", "eagle"), ("--speculative-algorithm", ""),
    ("--speculative-num-draft-tokens", "0"), ("--speculative-num-draft-tokens", "65"),
    ("--speculative-num-draft-tokens", "2.5"),
    ("--speculative-ngram-min-match-window-size", "0"),
    ("--speculative-ngram-max-match-window-size", "x")])
def test_bad_speculative_values_are_refused_while_parsing(no_start, capsys, command, flag,
                                                          value):
    line = cli_error(capsys, [command, "--model", "tiny", "--speculative-algorithm", "ngram",
                              flag, value])
    assert f"argument {flag}:" in line


@pytest.mark.parametrize("argv, says", [
    (["--speculative-num-draft-tokens", "4"],
     "--speculative-num-draft-tokens needs --speculative-algorithm"),
    (["--speculative-ngram-max-match-window-size", "4"],
     "--speculative-ngram-max-match-window-size needs --speculative-algorithm"),
    (["--speculative-algorithm", "mtp", "--speculative-ngram-min-match-window-size", "2"],
     "--speculative-ngram-min-match-window-size is for --speculative-algorithm ngram"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "5"],
     "--speculative-ngram-min-match-window-size (5) must be <= "
     "--speculative-ngram-max-match-window-size (3, its default)"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-min-match-window-size", "3",
      "--speculative-ngram-max-match-window-size", "2"], "(3) must be <= "),
])
def test_speculative_flags_that_do_not_go_together_are_refused(no_start, capsys, argv, says):
    """Before any model loads or any port is bound: one line, exit 2."""
    line = cli_error(capsys, ["serve", "--model", "tiny", *argv])
    assert says in line
