"""The MTP block's forward over the pools: its attention is one more sliding-window layer
(index num_hidden_layers) whose KV lives in the `swa` pool beside the trunk's, written and
read through the same page tables, so a prefix hit serves the drafter as well.

At position i the block reads the trunk's last hidden h_i and the next token t_{i+1}, and
predicts t_{i+2} (model/mtp.py). Chained drafting feeds its own output hidden back in
place of the trunk's, one position further each time.
"""

from __future__ import annotations

from typing import Any

import torch

from shadowradix.model.context import PagedStorage, RequestKV
from shadowradix.model.mtp import MTP_LAYER_TYPE, MTPBlock
from shadowradix.model.runner import Step, decoder_layer


class MTPRunner:
    """Runs an MTPBlock with the trunk's (transformers) embedding and head."""

    layer_type = MTP_LAYER_TYPE

    def __init__(self, block: MTPBlock, hf_model: Any) -> None:
        self.block = block.eval()
        self.hf = hf_model

    @torch.no_grad()
    def forward(self, segments: list[tuple[torch.Tensor, torch.Tensor, int, RequestKV]],
                store: PagedStorage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Segments (hidden [L, hc, D], next tokens [L], first position, page tables),
        one per request: the block at positions [start, start + L). Returns each
        segment's logits [L, vocab] (float32) and output hidden [L, hc, D]."""
        ids = torch.cat([seg[1] for seg in segments])
        step = Step.of([(next_ids, start, kv) for _, next_ids, start, kv in segments])
        block = self.block
        hidden = block.combine(torch.cat([seg[0] for seg in segments])[None], ids[None],
                               self.hf.model.embed_tokens)
        shaped = hidden[:, :, 0]
        rope = {kind: block.rotary_emb(shaped, position_ids=step.positions[None],
                                       layer_type=kind) for kind in ("main", "compress")}
        out = decoder_layer(block.layer, hidden, ids, step, rope, store)
        logits = block.head(out, self.hf.lm_head)[0].float()
        return [logits[a:b] for a, b in step.spans], [out[0, a:b] for a, b in step.spans]
