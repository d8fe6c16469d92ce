"""The CSA / HCA compressors and the indexer's compressor, over a request's own state.

Same math as transformers' DeepseekV4{HCA,CSA}Compressor and DeepseekV4Indexer,
but the unfinished window and the CSA overlap live in the request's
CompressorState, and the emitted entries are returned for the caller to write
into its pool (one entry per `ratio` tokens, at position window * ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from shadowradix.model.context import CompressorState, RequestKV


@dataclass
class Journal:
    """What one `compress` call started from and computed, for `rewind`: the state before,
    and the rows it concatenated (the buffered ones, then the chunk's projections)."""

    before: CompressorState | None = None
    kv: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    module: Any = None
    overlap: bool = False

    def rewind(self, keep: int) -> CompressorState:
        """The state after only the chunk's first `keep` rows: the same tensors `compress`
        would have kept had it been given those rows alone (bit for bit)."""
        before, kv, gate = self.before, self.kv, self.gate
        assert before is not None and kv is not None and gate is not None
        ratio, hd = self.module.compress_rate, self.module.head_dim
        total = before.buffer_kv.shape[0] + keep
        usable = total // ratio * ratio
        state = CompressorState(kv[usable:total], gate[usable:total], before.overlap_kv,
                                before.overlap_gate)
        if self.overlap and usable:  # the Ca half of the last window the kept rows closed
            state.overlap_kv = kv[usable - ratio:usable, :hd].clone()
            last = gate[usable - ratio:usable].view(1, ratio, -1) + self.module.position_bias
            state.overlap_gate = last[0, :, :hd].clone()
        return state


def rewind_states(req: RequestKV, keep: int) -> None:
    """Put every compressor and indexer state of a journaled chunk (a speculative step)
    back at its first `keep` rows: the rejected drafts' rows are forgotten."""
    journals, req.journal = req.journal, None
    assert journals is not None, "rewind_states without a journaled forward"
    for key, journal in journals.items():
        req.states[key] = journal.rewind(keep)


def compress(module: Any, hidden: torch.Tensor, state: CompressorState,
             first_window: int, overlap: bool,
             journal: Journal | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Close every window completed by `hidden` ([L, hidden]); update `state`.

    Returns (entries [n_windows, head_dim] with RoPE at each window's start,
    overlaps): for CSA, overlaps[i] is the [2, ratio, head_dim] (kv, gate) Ca half
    of the i-th closed window, the state to snapshot at a page end there.
    `journal`: filled with what `rewind` needs to put the state back at any row.
    """
    ratio, hd = module.compress_rate, module.head_dim
    before = CompressorState(state.buffer_kv, state.buffer_gate, state.overlap_kv,
                             state.overlap_gate)
    kv = torch.cat([state.buffer_kv, module.kv_proj(hidden)])
    gate = torch.cat([state.buffer_gate, module.gate_proj(hidden)])
    if journal is not None:
        journal.before, journal.kv, journal.gate = before, kv, gate
        journal.module, journal.overlap = module, overlap
    usable = kv.shape[0] // ratio * ratio
    state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
    n = usable // ratio
    if n == 0:
        return kv.new_zeros((0, hd)), []
    chunk_kv = kv[:usable].view(n, ratio, -1)
    chunk_gate = gate[:usable].view(n, ratio, -1) + module.position_bias
    overlaps: list[torch.Tensor] = []
    if overlap:
        # Entry w mixes window w-1's Ca half ([..., :hd]) with window w's Cb half.
        mix_kv = chunk_kv.new_zeros((n, 2 * ratio, hd))
        mix_gate = chunk_gate.new_full((n, 2 * ratio, hd), float("-inf"))
        mix_kv[:, ratio:] = chunk_kv[..., hd:]
        mix_gate[:, ratio:] = chunk_gate[..., hd:]
        mix_kv[1:, :ratio] = chunk_kv[:-1, :, :hd]
        mix_gate[1:, :ratio] = chunk_gate[:-1, :, :hd]
        if state.overlap_kv is not None and state.overlap_gate is not None:
            mix_kv[0, :ratio] = state.overlap_kv
            mix_gate[0, :ratio] = state.overlap_gate
        state.overlap_kv = chunk_kv[-1, :, :hd].clone()
        state.overlap_gate = chunk_gate[-1, :, :hd].clone()
        overlaps = [torch.stack([chunk_kv[i, :, :hd], chunk_gate[i, :, :hd]]) for i in range(n)]
        chunk_kv, chunk_gate = mix_kv, mix_gate
    weights = chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)
    entries = module.kv_norm((chunk_kv * weights).sum(dim=1))
    positions = (torch.arange(n, device=hidden.device) * ratio + first_window).unsqueeze(0)
    cos, sin = module.rotary_emb(entries, position_ids=positions, layer_type="compress")
    entries = apply_rotary_pos_emb(entries.unsqueeze(0).unsqueeze(0), cos, sin)[0, 0]
    return entries, overlaps


def empty_state(module: Any, like: torch.Tensor) -> CompressorState:
    """No buffered rows, in the dtype the projections produce (on `like`'s device)."""
    kv, gate = module.kv_proj.weight, module.gate_proj.weight
    return CompressorState(like.new_zeros((0, kv.shape[0]), dtype=kv.dtype),
                           like.new_zeros((0, gate.shape[0]), dtype=gate.dtype))
