"""The command line with bad input: one clear line naming the flag (or the file and line)
and a non-zero exit, never a traceback, a flag quietly replaced by a default, or a result
computed from a value it silently changed. Runs `cli.main` in-process (the real parser and
commands); `serve` and `fleet` are stubbed, so nothing starts even if a check is missing."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shadowradix.cli import main
from shadowradix.flags import float_range, int_range
from shadowradix.layout import deepseek_v4_flash
from shadowradix.sim.simulate import policy_choice, simulate
from shadowradix.sim.synth import ChatShape, Lengths, ShapeError, synth_trace
from shadowradix.sim.trace import TraceRequest, load_trace

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
GOOD_LINE = json.dumps(GOOD)


def error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI expecting exit status 2; returns stderr's error line. An argparse error
    (SystemExit) prints its usage first; a command's own error is the only line."""
    try:
        rc = main(argv)
        parsed = True
    except SystemExit as e:
        rc, parsed = e.code, False
    err = capsys.readouterr().err
    assert rc == 2, f"exit {rc}, stderr: {err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if parsed:
        assert len(lines) == 1, err
    assert lines[-1].startswith("shadowradix") and "error:" in lines[-1], err
    return lines[-1]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD_LINE + "\n")
    return path


# ------------------------------------------------------------------------ traces
@pytest.mark.parametrize("line, says", [
    ('{"timestamp": Infinity, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
     "timestamp"),
    ('{"timestamp": 1e400, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
     "timestamp"),
    ('{"timestamp": 0, "input_length": 600.7, "output_length": 1, "hash_ids": [1, 2]}',
     "input_length must be an integer, got 600.7"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 10.7, "hash_ids": [1, 2]}',
     "output_length must be an integer"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1.5, 2]}',
     "hash_ids[0] must be an integer"),
    ('{"timestamp": 0, "input_length": 600, "output_length": true, "hash_ids": [1, 2]}',
     "output_length must be an integer, got true"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [true, 2]}',
     "hash_ids[0]"),
    ('{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": "12"}',
     "hash_ids must be a list"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], '
     '"sequence_hash_ids": "12"}', "sequence_hash_ids must be a list"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], '
     '"block_size": 512.5}', "block_size must be an integer"),
    ('[1, 2]', "JSON object"),
])
def test_a_bad_trace_line_names_file_line_and_field(tmp_path, capsys, line, says):
    path = tmp_path / "bad.jsonl"
    path.write_text(GOOD_LINE + "\n" + line + "\n")
    msg = error_line(capsys, ["simulate", str(path)])
    assert "bad.jsonl:2:" in msg and says in msg


def test_integral_floats_and_fractional_timestamps_still_load(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text(json.dumps({**GOOD, "input_length": 600.0, "timestamp": 12.6}) + "\n")
    (req,) = load_trace(path)
    assert (req.input_length, req.timestamp) == (600, 13)
    assert type(req.input_length) is int


def test_a_truncated_gzip_trace_names_the_line_it_stopped_at(tmp_path, capsys):
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join([GOOD_LINE] * 50)).encode())[:-20])
    msg = error_line(capsys, ["simulate", str(path)])
    assert "cut.jsonl.gz:" in msg and "truncated" in msg


@pytest.mark.parametrize("data", [b"not gzip at all", b"\x1f\x8b\x08\x00garbage" * 8])
def test_a_corrupt_gzip_trace_is_one_line(tmp_path, capsys, data):
    path = tmp_path / "bad.jsonl.gz"
    path.write_bytes(data)
    assert "bad.jsonl.gz:1:" in error_line(capsys, ["simulate", str(path)])


def test_a_trace_that_is_not_utf8_names_the_line(tmp_path, capsys):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n\xff\xfe\n")
    assert "bin.jsonl:2:" in error_line(capsys, ["simulate", str(path)])


@pytest.mark.parametrize("field, value", [("input_length", True), ("input_length", 600.0),
                                          ("timestamp", 1.5), ("hash_ids", (1.0, 2))])
def test_trace_requests_refuse_what_is_not_an_integer(field, value):
    with pytest.raises(ValueError, match="integer"):
        TraceRequest(**{**GOOD, "hash_ids": (1, 2), field: value})


# ------------------------------------------------------------------------ trace synth
@pytest.mark.parametrize("flags, says", [
    (["--think-time", "inf"], "--think-time"),
    (["--think-time", "nan"], "--think-time"),
    (["--rate", "inf"], "--rate"),
    (["--rate", "0"], "--rate"),
    (["--rate", "1e-310"], "--rate"),  # finite, but the arrival times overflow
    (["--think-time", "1e306"], "--think-time"),
    (["--system-tokens", "1e12"], "--system-tokens"),  # would allocate terabytes
    (["--system-tokens", "inf"], "--system-tokens"),
    (["--system-tokens", "200,inf"], "--system-tokens"),
    (["--prompt-tokens", "200,-1"], "--prompt-tokens"),
    (["--reply-tokens", "0"], "--reply-tokens"),
    (["--reply-tokens", "many"], "--reply-tokens"),
    (["--max-context", "1000", "--system-tokens", "5000"], "--system-tokens"),
    (["--turns-max", "100000"], "--turns-max"),
    (["--turns-min", "3", "--turns-max", "2"], "--turns-max"),
    (["--turns-min", "0"], "--turns-min"),
    (["--seed", "-1"], "--seed"),
    (["--block-size", "0"], "--block-size"),
    (["--conversations", "0"], "--conversations"),
])
def test_trace_synth_refuses_bad_shapes_naming_the_flag(tmp_path, capsys, flags, says):
    out = tmp_path / "o.jsonl"
    msg = error_line(capsys, ["trace", "synth", "--conversations", "3", *flags, "-o", str(out)])
    assert says in msg
    assert not out.exists()


def test_trace_synth_that_yields_no_request_is_an_error(tmp_path, capsys):
    out = tmp_path / "o.jsonl"  # every system prompt is longer than the context
    msg = error_line(capsys, ["trace", "synth", "--max-context", "40", "--system-tokens",
                              "40,0", "--prompt-tokens", "10,0", "--reply-tokens", "10,0",
                              "-o", str(out)])
    assert "--max-context" in msg


def test_a_long_tail_is_clipped_not_allocated():
    # sigma 30: draws reach 1e100s; clipping at max_context + 1 ends those conversations
    # exactly where they ended before, without building the tokens.
    shape = ChatShape(conversations=30, system_tokens=Lengths(100, 30.0),
                      prompt_tokens=Lengths(50, 30.0), max_context=4096, seed=1)
    trace = synth_trace(shape)
    assert trace and all(r.sequence_length <= 4096 for r in trace)


def test_chat_shape_names_the_field():
    with pytest.raises(ShapeError) as e:
        ChatShape(think_time=math.inf)
    assert e.value.field == "think_time"
    with pytest.raises(ValueError, match="sigma"):
        Lengths(100, math.inf)


# ------------------------------------------------------------------------ trace from-chats
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from shadowradix.server.tokenizer import tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tiny_tokenizer(1024).save_pretrained(path)
    return path


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.mark.parametrize("line, says", [
    (r'{"messages": [{"role": "user", "content": "a \ud800 b"}, '
     r'{"role": "assistant", "content": "yo"}]}', "surrogate"),
    (json.dumps({**CHAT, "timestamp": None})[:-1] + ', "timestamp": Infinity}', "timestamp"),
    (json.dumps(CHAT)[:-1] + ', "timestamp": 1e400}', "timestamp"),
    (json.dumps({**CHAT, "timestamp": True}), "timestamp"),
])
def test_from_chats_names_the_bad_line(tokenizer_dir, tmp_path, capsys, line, says):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps(CHAT) + "\n" + line + "\n")
    msg = error_line(capsys, ["trace", "from-chats", str(chats), "--tokenizer",
                              str(tokenizer_dir), "-o", str(tmp_path / "o.jsonl")])
    assert "chats.jsonl:2:" in msg and says in msg


@pytest.mark.parametrize("flags", [["--gap-ms", "-1"], ["--block-size", "0"]])
def test_from_chats_flags_are_checked(tmp_path, capsys, flags):
    msg = error_line(capsys, ["trace", "from-chats", str(tmp_path / "c.jsonl"), "--tokenizer",
                              str(tmp_path), *flags, "-o", str(tmp_path / "o.jsonl")])
    assert flags[0] in msg


# ------------------------------------------------------------------------ simulate
@pytest.mark.parametrize("flags, says", [
    (["--window-ratio", "0"], "--window-ratio"),  # was: silently the shared budget
    (["--window-ratio", "1.5"], "--window-ratio"),
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--policy", ","], "--policy"),
    (["--policy", ",", "--json", "OUT"], "--policy"),
    (["--policy", "bogus"], "--policy"),
    (["--write-policy", "bogus"], "--write-policy"),  # was: ignored without --host-gb
    (["--device-gb", "nan"], "--device-gb"),
    (["--device-gb", "inf"], "--device-gb"),
    (["--device-gb", "0"], "--device-gb"),
    (["--host-gb", "nan"], "--host-gb"),
    (["--host-gb", "-1"], "--host-gb"),
    (["--storage-gb", "nan"], "--storage-gb"),
    (["--sweep", "device-gb=10,nan"], "--sweep"),
    (["--page-size", "0"], "--page-size"),
    (["--chunk-pages", "0"], "--chunk-pages"),
    (["--limit", "0"], "--limit"),
    (["--hisparse-buffer", "0"], "--hisparse-buffer"),
    (["--index-topk", "-3"], "--index-topk"),
])
def test_simulate_refuses_bad_flags_naming_them(trace, tmp_path, capsys, flags, says):
    flags = [str(tmp_path / "o.json") if f == "OUT" else f for f in flags]
    assert says in error_line(capsys, ["simulate", str(trace), *flags])


def test_simulate_takes_an_unbounded_store(trace, tmp_path):
    out = tmp_path / "o.json"
    assert main(["simulate", str(trace), "--policy", "end-only", "--device-gb", "1",
                 "--storage-gb", "inf", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["storage_gb"] == math.inf


def test_the_library_refuses_what_the_flags_refuse():
    with pytest.raises(ValueError, match="window_ratio"):
        policy_choice("end-only", window_ratio=0)
    with pytest.raises(ValueError, match="checkpoint_every"):
        policy_choice("periodic", checkpoint_every=0)
    req = [TraceRequest(0, 600, 10, (1, 2))]
    for kwargs, says in [({"host_gb": math.nan}, "host_gb"), ({"storage_gb": math.nan},
                         "storage_gb"), ({"write_policy": "bogus"}, "write_policy")]:
        with pytest.raises(ValueError, match=says):
            simulate(req, deepseek_v4_flash(), policy_choice("end-only"), 1.0, **kwargs)
    with pytest.raises(ValueError, match="device_gb"):
        simulate(req, deepseek_v4_flash(), policy_choice("end-only"), math.nan)


# ------------------------------------------------------------------------ serve, fleet, demo
@pytest.fixture
def no_start(monkeypatch):
    """serve and fleet that fail the test instead of starting: a flag that got through
    the parser would otherwise start a server (or load a model that then fails)."""
    import shadowradix.demo
    import shadowradix.server.fleet
    import shadowradix.server.serve

    def started(*_: object) -> int:
        raise AssertionError("the command started: its flags passed the parser")

    monkeypatch.setattr(shadowradix.server.serve, "serve", started)
    monkeypatch.setattr(shadowradix.server.fleet, "run_fleet", started)
    monkeypatch.setattr(shadowradix.demo, "run_demo", started)


SERVE_FLAGS = [("--port", "70000"), ("--port", "-1"), ("--step-tokens", "0"),
               ("--page-size", "0"), ("--max-queue", "0"), ("--device-tokens", "0"),
               ("--host-tokens", "-16"), ("--window-tokens", "0"), ("--state-tokens", "0"),
               ("--hisparse-buffer", "0"), ("--hisparse-requests", "0"),
               ("--drain-timeout", "nan"), ("--drain-timeout", "-1"), ("--page-size", "1.5"),
               ("--policy", "periodic-0"), ("--write-policy", "bogus")]


@pytest.mark.parametrize("command", ["serve", "fleet"])
@pytest.mark.parametrize("flag, value", SERVE_FLAGS)
def test_serve_flags_are_checked_while_parsing(no_start, capsys, command, flag, value):
    msg = error_line(capsys, [command, "--model", "tiny", flag, value])
    assert f"argument {flag}:" in msg


@pytest.mark.parametrize("flag, value", [("--instances", "0"), ("--start-timeout", "inf"),
                                         ("--start-timeout", "0")])
def test_fleet_flags_are_checked_while_parsing(no_start, capsys, flag, value):
    assert f"argument {flag}:" in error_line(capsys, ["fleet", "--model", "tiny", flag, value])


@pytest.mark.parametrize("flag", ["--requests", "--block-tokens"])
def test_demo_flags_are_checked_while_parsing(no_start, capsys, flag):
    assert f"argument {flag}:" in error_line(capsys, ["demo", flag, "0"])


def test_the_flag_types():
    assert int_range(0, 65535)("65535") == 65535 and int_range(1)(" 7 ") == 7
    assert float_range(0.0, infinite=True)("inf") == math.inf
    with pytest.raises(Exception, match="finite"):
        float_range(0.0)("1e400")


def test_the_real_command_line_exits_2_with_one_line(tmp_path):
    """End to end: the installed entry point, as a user runs it."""
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join([GOOD_LINE] * 50)).encode())[:-20])
    for argv, says in [(["simulate", str(path)], "cut.jsonl.gz:"),
                       (["serve", "--model", "tiny", "--port", "70000"], "--port")]:
        run = subprocess.run([sys.executable, "-m", "shadowradix", *argv], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert says in run.stderr.strip().splitlines()[-1]
