"""Two engines in lockstep, HiSparse off and on, under random traffic: requests that share
prefixes, preemption in a small device, aborts mid-decode and device flushes. Every step
must give the same tokens, and every finished request bitwise the same logits; pages and
hot buffers are all accounted for after every rule."""

from __future__ import annotations

import torch
from conftest import STEPS
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_tree_machine import steps
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams

MODEL = tiny_model()
VOCAB = 256


class HiSparseMachine(RuleBasedStateMachine):
    buffer = 5  # the tiny model's index_topk + 1

    def __init__(self) -> None:
        super().__init__()
        # Fixed pools (window_tokens set): HiSparse takes the C4 pool out of an arena, so
        # over one the two engines would hold different pages and preempt differently.
        base = {"page_size": 16, "device_tokens": 384, "window_tokens": 384}
        self.off = Engine(MODEL, CacheConfig(**base), step_tokens=48)
        # Enough hot-buffer sets never to hold back admission: the steps then batch the
        # same requests, so even float rounding must agree.
        self.on = Engine(MODEL, CacheConfig(**base, hisparse_buffer=self.buffer,
                                            hisparse_requests=64), step_tokens=48)
        self.sequences: list[list[int]] = []
        self.live: set[str] = set()
        self.steps = -1

    @rule(data=st.data(), n=st.integers(1, 70), new=st.integers(1, 40))
    def add(self, data: st.DataObject, n: int, new: int) -> None:
        prefix = data.draw(st.sampled_from(self.sequences)) if self.sequences and \
            data.draw(st.booleans()) else []
        prompt = prefix + data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n,
                                             max_size=n))
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        rid = self.off.add_request(prompt, params, return_logits=True)
        assert self.on.add_request(prompt, params, return_logits=True) == rid
        self.live.add(rid)

    @precondition(lambda self: self.live)
    @rule(times=st.integers(1, 8))
    def step(self, times: int) -> None:
        for _ in range(times):
            a, b = self.off.step(), self.on.step()
            assert [(o.request_id, o.new_token_ids, o.finished) for o in a] == [
                (o.request_id, o.new_token_ids, o.finished) for o in b]
            for x, y in zip(a, b, strict=True):
                if x.finished:
                    assert x.result is not None and y.result is not None
                    assert torch.equal(x.result.logits, y.result.logits)
                    self.live.discard(x.request_id)
                    self.sequences.append(list(x.result.output_ids))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.off.abort(rid)
        self.on.abort(rid)
        self.live.discard(rid)

    @rule()
    def flush_device(self) -> None:
        self.off.cache.flush(tiers=("device",))
        self.on.cache.flush(tiers=("device",))

    @invariant()
    def accounted(self) -> None:
        self.steps += 1
        self.on.check_integrity()
        hs = self.on.stats()["hisparse"]
        assert hs["in_use"] == len(self.on.scheduler.running)
        assert self.on.stats()["preemptions"] == self.off.stats()["preemptions"]

    def teardown(self) -> None:
        STEPS[type(self).__name__] = STEPS.get(type(self).__name__, 0) + max(self.steps, 0)
        for rid in list(self.live):
            self.on.abort(rid)
        assert self.on.stats()["hisparse"]["in_use"] == 0
        self.on.check_integrity()


class WideBufferMachine(HiSparseMachine):
    buffer = 12  # histories cross from the fast path into replacement mid-decode


TestHiSparse = HiSparseMachine.TestCase
TestHiSparse.settings = steps(12)
TestWideBuffer = WideBufferMachine.TestCase
TestWideBuffer.settings = steps(8)
