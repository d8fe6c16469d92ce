"""A step is a transaction for request state (DESIGN.md §4).

The cache manager undoes or completes every page change on its own (tiers/manager.py);
what it cannot see is the request's side: the compressor and indexer states the forward
advances in place, the recorded selections, the hot buffers, the sampled token, the
generator's position. `Snapshot.take` records them before a step touches the request;
`restore_model` puts back what the forward changed (the request keeps running and the
retried step recomputes the same chunk, exact), `restore_outputs` also what sampling
changed (the request goes back to the queue and redoes the step from the cache).

The snapshot is shallow and cheap: the forward replaces a state's tensors, it never
writes into them, so keeping the old references keeps the old state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shadowradix.engine.request import Request
from shadowradix.model.context import CompressorState
from shadowradix.sparse.hot_buffer import HotSet


@dataclass
class Snapshot:
    states: dict[tuple[int, str], CompressorState]
    topk: dict[int, int] | None  # entries of each layer's selection log
    ids: int  # len(req.ids)
    logits: int  # len(req.logits)
    generator: torch.Tensor | None  # the generator's state (sampling requests)

    @classmethod
    def take(cls, req: Request, samples: bool) -> Snapshot:
        """`samples`: the step draws a token for it (only then is the generator's state
        worth keeping: a prefill chunk short of the end draws nothing)."""
        states = {} if req.kv is None else {
            key: CompressorState(s.buffer_kv, s.buffer_gate, s.overlap_kv, s.overlap_gate)
            for key, s in req.kv.states.items()}
        topk = None if req.topk is None else {layer: len(log) for layer, log in req.topk.items()}
        gen = req.generator.get_state() if samples and req.generator is not None else None
        return cls(states, topk, len(req.ids), len(req.logits), gen)

    def restore_model(self, req: Request) -> None:
        """Undo what a forward did to the request: its states, its selection log and its
        hot buffers (which may have planned copies that never ran)."""
        if req.kv is not None:
            req.kv.states = dict(self.states)
            if isinstance(req.kv.c4, HotSet):
                req.kv.c4.reset()
        self._restore_topk(req)

    def restore_outputs(self, req: Request) -> None:
        """Undo what booking a step did to the request's outputs: the tokens, their
        logits, the positions they made computed and the generator's draws (a retry
        samples the same tokens again)."""
        del req.ids[self.ids:]
        req.computed = min(req.computed, len(req.ids))  # a verify step books past them
        del req.logits[self.logits:]
        if req.generator is not None and self.generator is not None:
            req.generator.set_state(self.generator)
        self._restore_topk(req)

    def _restore_topk(self, req: Request) -> None:
        if req.topk is not None and self.topk is not None:
            for layer in list(req.topk):
                del req.topk[layer][self.topk.get(layer, 0):]
