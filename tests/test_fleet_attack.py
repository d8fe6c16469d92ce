"""Attacks on the fleet's guarantees (issue #20): --router-args cannot move the router off
--host, its metrics off --host, or its workers elsewhere, even by an abbreviation that the
router's own parser (argparse) takes for the full flag; SIGTERM or SIGINT repeated while
the fleet stops still ends in exit 0."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_util import child_pids

from shadowradix.server import fleet

ROOT = Path(__file__).resolve().parent.parent

OVERRIDES = [
    "--hos 0.0.0.0",              # --host: the router on every interface
    "--hos=0.0.0.0",
    "--prometheus-ho 0.0.0.0",    # --prometheus-host: its metrics, without the API key
    "--prometheus-p 29000",       # --prometheus-port
    "--worker-u http://10.0.0.9:8000",  # --worker-urls: traffic to another machine
    "--por 8080",                 # --port
]


def fleet_args(router_args: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    fleet.add_arguments(ap)
    return ap.parse_args(["--model", "tiny", "--host", "127.0.0.1", "--port", "0",
                          f"--router-args={router_args}"])


@pytest.mark.parametrize("words", OVERRIDES)
def test_the_router_takes_an_abbreviation_for_the_fleets_own_flag(words):
    """Why the check below matters: the router's parser reads each of these as the flag it
    abbreviates, and the last one given wins over the fleet's."""
    from sglang_router.launch_router import parse_router_args

    argv = fleet.router_argv(fleet_args(""), ["http://127.0.0.1:1"], 30001, 30002)
    got = parse_router_args([*argv[3:], *words.replace("=", " ").split()])
    assert (got.host, got.port, got.prometheus_host, got.prometheus_port,
            got.worker_urls) != ("127.0.0.1", 30001, "127.0.0.1", 30002,
                                 ["http://127.0.0.1:1"])


@pytest.mark.parametrize("words", OVERRIDES)
def test_an_abbreviated_own_flag_in_router_args_is_refused(words):
    """Only the flags' full names were refused: `--hos 0.0.0.0` put the router (and
    `--prometheus-ho 0.0.0.0` its unauthenticated metrics) on every interface for as long
    as the fleet waited for its readiness (--start-timeout, 600 s), then it exited 1."""
    with pytest.raises(ValueError, match="is the fleet's own --"):
        fleet._check(fleet_args(words))


@pytest.mark.parametrize("words", ["--health-check-interval-secs 10", "--log-level debug",
                                   "--prometheus-duration-buckets 0.1 1", "--policy random"])
def test_other_router_flags_still_pass(words):
    fleet._check(fleet_args(words))


# ------------------------------------------------------------------ signals
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_repeated_until_the_fleet_exits_still_exit_0(signum):
    """A supervisor that repeats SIGTERM (or a held Ctrl-C) while the fleet starts: the
    first stops it; the ones that came after its stop restored the old handlers killed it
    (exit -15, or -2 by a KeyboardInterrupt) instead of exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "shadowradix", "fleet", "--model", "tiny",
                             "--instances", "1", "--port", "0", "--drain-timeout", "2"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while not (kids := child_pids(proc.pid)):  # its handlers are in: it has a child
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.01)
        seen.update(kids)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(child_pids(proc.pid))
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
            time.sleep(0.002)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in seen:  # nothing left behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def test_a_sigterm_while_the_fleet_still_imports_exits_0():
    """`python -m shadowradix fleet` takes a few hundred milliseconds to import before
    the fleet installs its handlers; a SIGTERM then killed it (exit -15). The signal is
    sent for sure in that window: from the command's own start, before it parses."""
    code = ("import os, runpy, signal, sys\n"
            "import shadowradix.cli as cli\n"
            "main = cli.main\n"
            "def early(*a, **kw):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return main(*a, **kw)\n"
            "cli.main = early\n"
            "sys.argv = ['shadowradix', 'fleet', '--model', 'tiny', '--instances', '1',\n"
            "            '--port', '0']\n"
            "runpy.run_module('shadowradix', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fleet of" not in proc.stderr  # it never announced itself
