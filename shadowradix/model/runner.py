"""A DeepSeek-V4 forward that reads and writes the pools, one request chunk at a time.

Embedding, mHC, MoE, norms and the head are transformers' own modules and
weights; only attention goes through `paged_attention`.
"""

from __future__ import annotations

from typing import Any

import torch

from shadowradix.model.attention import paged_attention, resume_states
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
        model = self.hf.model
        L = input_ids.shape[0]
        positions = torch.arange(start, start + L, device=input_ids.device)
        embeds = model.embed_tokens(input_ids[None])
        hidden = embeds.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        rope = {kind: model.rotary_emb(embeds, position_ids=positions[None], layer_type=kind)
                for kind in ("main", "compress")}
        for layer in model.layers:
            attn = layer.self_attn
            dtype = hidden.dtype
            post, comb, collapsed = layer.attn_hc(hidden)
            out = paged_attention(attn, layer.input_layernorm(collapsed)[0], positions,
                                  rope[attn.rope_layer_type], store, req)
            hidden = post.to(dtype).unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
            post, comb, collapsed = layer.ffn_hc(hidden)
            mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=input_ids[None])
            hidden = post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(
                comb.to(dtype).transpose(-1, -2), hidden)
        hidden = model.norm(model.hc_head(hidden))
        return self.hf.lm_head(hidden)[0].float()
