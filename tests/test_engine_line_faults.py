"""A fault at any line of the engine's step (an interrupt between two statements, as a
signal arrives), then the caller stepping again, loses no output, sends none twice and
changes no answer: every request finishes, its stream is its result, and its logits are
transformers'. Before, lines between the forward and the booking were covered by no
handler (the forward had advanced the requests' compressor states and nothing put them
back: the retried step computed from them, other answers), a report counted its tokens
one statement before it queued them, and `step` took its outputs inside the lock whose
exit could still be interrupted (outputs lost, a request pending for good). Found by an
attack with line-level fault sweeps."""

from __future__ import annotations

import pytest
from helpers import LineFault
from test_engine import check, rand_tokens
from test_engine_arena import page_bytes
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

MODEL = tiny_model()
CODE = [getattr(Engine, name) for name in (
    "step", "_step", "_decide_all", "_advance", "_report", "_fail", "_interrupted")]
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _run(fault_step: int, nth: int) -> tuple[bool, int]:
    """Two requests to the end, the `fault_step`-th step under a fault at its `nth` line
    (0: only count its lines); stepping again after the fault. Checks the answers; returns
    whether the fault struck and how many lines that step ran."""
    eng = Engine.from_hf(MODEL, CacheConfig(page_size=16, device_bytes=12 * page_bytes(MODEL),
                                            debug_poison=True), step_tokens=64)
    prompts = {eng.add_request(p, PARAMS, return_logits=True): p
               for p in (rand_tokens(30, 1), rand_tokens(43, 2))}
    streamed: dict[str, list[int]] = {rid: [] for rid in prompts}
    results = {}
    fault, steps = LineFault(CODE, nth), 0
    while len(results) < len(prompts):
        steps += 1
        assert steps < 60, "a request never finished"
        try:
            if steps == fault_step:
                with fault:
                    outputs = eng.step()
            else:
                outputs = eng.step()
        except KeyboardInterrupt:
            assert fault.hit
            continue
        for out in outputs:
            assert out.request_id not in results, "reported after it finished"
            streamed[out.request_id] += out.new_token_ids
            if out.finished:
                results[out.request_id] = out.result
    for rid, result in results.items():
        assert streamed[rid] == result.output_ids, (rid, streamed[rid], result.output_ids)
        check(MODEL, prompts[rid], result, greedy=True)
    eng.cache.flush()
    eng.check_integrity()
    return fault.hit, fault.lines


@pytest.mark.parametrize("fault_step", [1, 3])  # a prefill (two chunks), then decodes
def test_a_fault_at_any_line_of_a_step_loses_and_changes_nothing(fault_step):
    _, lines = _run(fault_step, 0)
    assert lines > 20
    for nth in range(1, lines + 1):
        hit, _ = _run(fault_step, nth)
        assert hit, nth
