"""A DeepSeek-V4 forward that reads and writes the pools, one request chunk at a time.

Embedding, mHC, MoE, norms and the head are transformers' own modules and
weights; only attention goes through `attention_layer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from shadowradix.model.attention import attention_layer, resume_states
from shadowradix.model.context import PagedStorage, RequestKV


class DeepseekV4Runner:
    """Wraps a `DeepseekV4ForCausalLM`; never sees the tree, only page tables."""

    def __init__(self, hf_model: Any) -> None:
        self.hf = hf_model
        self.config = hf_model.config
        self.layer_types = list(self.config.layer_types)

    @property
    def attentions(self) -> list[Any]:
        return [layer.self_attn for layer in self.hf.model.layers]

    def resume(self, store: PagedStorage, req: RequestKV, resume_pages: int) -> None:
        """Restore the compressor state of a request that resumes at a cached page end."""
        like = self.hf.model.embed_tokens.weight
        resume_states(store, req, self.layer_types, self.attentions, resume_pages, like)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, start: int, store: PagedStorage,
                req: RequestKV) -> torch.Tensor:
        """Logits [L, vocab] for tokens `input_ids` [L] at positions [start, start + L)."""
        return self.forward_batch([(input_ids, start, req)], store)[0]

    @torch.no_grad()
    def forward_batch(self, segments: list[tuple[torch.Tensor, int, RequestKV]],
                      store: PagedStorage) -> list[torch.Tensor]:
        """One step over several requests' chunks (prefill chunks and decode tokens).

        Every per-token module (embedding, mHC, MoE, norms, head, attention's projections)
        runs once over all tokens of the step; attention reads and writes keys per request
        over its own page tables.
        Returns each segment's logits [L_i, vocab].
        """
        return self.forward_hidden(segments, store)[0]

    @torch.no_grad()
    def forward_hidden(self, segments: list[tuple[torch.Tensor, int, RequestKV]],
                       store: PagedStorage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`forward_batch`, also returning each segment's last hidden state before the
        head, [L_i, hc_mult, hidden] (what an MTP block reads)."""
        model = self.hf.model
        ids = torch.cat([seg[0] for seg in segments])
        step = Step.of(segments)
        embeds = model.embed_tokens(ids[None])
        hidden = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        rope = {kind: model.rotary_emb(embeds, position_ids=step.positions[None],
                                       layer_type=kind) for kind in ("main", "compress")}
        for layer in model.layers:
            hidden = decoder_layer(layer, hidden, ids, step, rope, store)
        logits = self.hf.lm_head(model.norm(model.hc_head(hidden)))[0].float()
        return ([logits[a:b] for a, b in step.spans], [hidden[0, a:b] for a, b in step.spans])


@dataclass(frozen=True)
class Step:
    """Where each request's rows lie in one forward: positions [T], its row span, its KV."""

    positions: torch.Tensor
    spans: list[tuple[int, int]]
    requests: list[RequestKV]

    @classmethod
    def of(cls, segments: list[tuple[torch.Tensor, int, RequestKV]]) -> Step:
        device = segments[0][0].device
        positions = torch.cat([torch.arange(start, start + seg.shape[0], device=device)
                               for seg, start, _ in segments])
        bounds = [0]
        for seg, _, _ in segments:
            bounds.append(bounds[-1] + seg.shape[0])
        return cls(positions, list(pairwise(bounds)), [req for _, _, req in segments])


def decoder_layer(layer: Any, hidden: torch.Tensor, ids: torch.Tensor, step: Step,
                  rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                  store: PagedStorage) -> torch.Tensor:
    """One transformers DeepseekV4DecoderLayer over the step's rows [1, T, hc, hidden],
    its attention through the pools; `ids` [T]: the tokens hash routing reads."""
    attn = layer.self_attn
    dtype = hidden.dtype
    post, comb, collapsed = layer.attn_hc(hidden)
    normed = layer.input_layernorm(collapsed)[0]
    out = attention_layer(attn, normed, step.positions, step.spans, rope[attn.rope_layer_type],
                          store, step.requests)
    hidden = post.to(dtype).unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), hidden)
    post, comb, collapsed = layer.ffn_hc(hidden)
    mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids[None])
    return post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), hidden)
