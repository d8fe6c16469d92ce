"""The engine refuses a KV cache larger than memory (Engine._check_memory,
validation.check_memory) with a ValueError that names the settings that sized it, and an
allocation that fails past the check is a ValueError too. From an attack on the first
version of the check: its advice named settings that could not help (device_bytes beside
window_tokens), left out HiSparse's hot buffers and the C4 pool device_tokens sizes in host
memory, and torch's CPU allocator error escaped as a RuntimeError."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine

ROOT = Path(__file__).resolve().parent.parent
PS = 16


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _refusal(model, **sizing) -> str:
    with pytest.raises(ValueError, match="KV cache needs") as e:
        Engine.from_hf(model, CacheConfig(page_size=PS, **sizing))
    return str(e.value)


def _advice(message: str) -> str:
    assert "give a smaller" in message, message
    return message.split("give a smaller", 1)[1]


@pytest.mark.parametrize("sizing, culprit", [
    (dict(device_tokens=PS, window_tokens=2**44), "window_tokens"),
    (dict(device_tokens=PS, state_tokens=2**44), "state_tokens"),
])
def test_refusal_advice_names_the_fixed_pool_setting_that_overflowed(
        model, sizing, culprit):
    """window_tokens / state_tokens alone size a pool past memory: the advice names that
    setting, not device_tokens (already the minimum), host_tokens (0) or device_bytes
    (which CacheConfig refuses beside window_tokens)."""
    advice = _advice(_refusal(model, **sizing))
    assert culprit in advice, advice
    assert "device_bytes" not in advice, f"device_bytes cannot be set with {culprit}: {advice}"


def test_refusal_names_hisparse_requests_when_the_hot_buffers_overflow(model):
    """hisparse_requests=10**8 asks for ~200 GiB of hot buffers beside a 256-token cache:
    the refusal names the hot buffers' settings (their bytes are hisparse_requests *
    hisparse_buffer * layers * entry bytes), which no cache size changes."""
    message = _refusal(model, device_tokens=256, hisparse_buffer=9, hisparse_requests=10**8)
    assert "hisparse_requests" in message, message


def test_refusal_names_device_tokens_sizing_hisparse_host_pool_beside_device_bytes(
        model):
    """With device_bytes and HiSparse, device_tokens still sizes the C4 pool kept in host
    memory (CacheConfig's docstring says so): a huge device_tokens is refused naming it,
    not only the device_bytes beside it."""
    message = _refusal(model, device_bytes=1 << 20, device_tokens=2**40, hisparse_buffer=9,
                       hisparse_requests=1)
    assert "device_tokens=1099511627776" in message, message


_ULIMIT = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {tests!r})
    from tiny_model import tiny_model
    from shadowradix import CacheConfig, Engine
    model = tiny_model()
    vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1])
    # an address-space limit (ulimit -v) 1 GiB above what the process maps now: the
    # machine's RAM (what the check compares with) is far larger than what it may take
    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (1 << 30), resource.RLIM_INFINITY))
    try:
        Engine.from_hf(model, CacheConfig(page_size=16, {sizing}))
        print("ACCEPTED")
    except Exception as e:
        print(type(e).__name__, str(e)[:200])
""")


@pytest.mark.parametrize("sizing", ["device_bytes=4 << 30",  # the arena
                                    "device_tokens=16, window_tokens=1 << 25"])  # fixed pools
def test_allocation_failing_past_the_check_on_cpu_is_a_value_error(sizing, tmp_path):
    """A cache that passes the check (4 GiB < this machine's RAM) and then cannot be
    allocated (ulimit -v, vm.overcommit_memory=2, a memory-limited job) is a ValueError,
    not torch's CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate
    memory")."""
    script = tmp_path / "ulimit.py"
    script.write_text(_ULIMIT.format(tests=str(ROOT / "tests"), sizing=sizing))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]  # ACCEPTED: 4 GiB fit under 1 GiB of room
    assert line.startswith("ValueError"), line


def test_a_cuda_device_and_host_memory_are_checked_apart(monkeypatch):
    """On a CUDA device the pools and hot buffers are checked against the device's memory
    and the host tier against this machine's, each naming its own settings (the CUDA
    branch, with the two sizes stubbed: no GPU here)."""
    from shadowradix.engine import validation

    gib = 2**30
    monkeypatch.setattr(validation, "memory_bytes",
                        lambda d: 80 * gib if d.type == "cuda" else 64 * gib)
    cuda = validation.torch.device("cuda", 0)
    pools = [("device_bytes=85899345920", 80 * gib, ("device_bytes",))]
    host = [("host_tokens=1000000", 60 * gib, ("host_tokens",))]
    validation.check_memory(cuda, pools, host)  # each fits its own memory
    with pytest.raises(ValueError, match=r"81\.0 GiB of cuda:0, which has 80\.0 GiB: "
                                         r"device_bytes=.*: 80\.0 GiB, HiSparse.*; give a "
                                         r"smaller device_bytes, hisparse_requests or "
                                         r"hisparse_buffer"):
        validation.check_memory(cuda, [*pools, ("HiSparse's hot buffers", gib,
                                                ("hisparse_requests", "hisparse_buffer"))],
                                host)
    with pytest.raises(ValueError, match=r"of this machine's memory.*give a smaller host_tokens$"):
        validation.check_memory(cuda, pools, [*host, ("host_tokens=2", 5 * gib,
                                                      ("host_tokens",))])
    # on the CPU both share this machine's memory: 80 + 60 GiB > 64 GiB
    with pytest.raises(ValueError, match=r"give a smaller device_bytes or host_tokens$"):
        validation.check_memory(validation.torch.device("cpu"), pools, host)
