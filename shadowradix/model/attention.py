"""DeepSeek-V4 attention over paged pools, for one request's chunk of positions.

Reuses the weights of transformers' DeepseekV4Attention; replaces only how keys
are stored and found:

    # swa       written at every position; the last W-1 before each query are gathered
    # c4        one entry per closed 4-window; only the indexer's top-k are gathered
    #           (HiSparse: the pool is in host memory, read through a hot buffer)
    # c4_index  one key per closed 4-window; the indexer scores all of them
    # c128      one entry per closed 128-window; all are read
    # state     the CSA overlap at each page end the chunk crosses, for exact resume
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from shadowradix.model.compressor import compress, empty_state
from shadowradix.model.context import CompressorState, PagedStorage, RequestKV

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
NEG_INF = float("-inf")


def paged_attention(attn: Any, hidden: torch.Tensor, positions: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor], store: PagedStorage,
                    req: RequestKV) -> torch.Tensor:
    """hidden [L, hidden] at `positions` (consecutive) -> attention output [L, hidden]."""
    layer, kind = attn.layer_idx, attn.layer_type
    cfg = attn.config
    n_heads, hd = attn.num_heads, attn.head_dim
    cos, sin = rope
    L = hidden.shape[0]
    start, end = int(positions[0]), int(positions[-1]) + 1

    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(1, L, n_heads, hd).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos, sin)[0]  # [H, L, hd]
    kv = attn.kv_norm(attn.kv_proj(hidden)).view(1, L, 1, hd).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)[0, 0]  # [L, hd]

    # Sliding window: write this chunk, read back [start - W + 1, end).
    swa = store.flat("swa", layer)
    table = req.page_tables["swa"]
    swa[store.address("swa", table, positions)] = kv
    window = attn.sliding_window
    kpos = torch.arange(max(start - window + 1, 0), end, device=hidden.device)
    keys = swa[store.address("swa", table, kpos)]
    logits = [torch.einsum("hld,kd->hlk", q, keys)]
    visible = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None] - window)
    masks = [visible]
    values = [keys.expand(L, -1, -1)]

    if kind == CSA:
        entries, selected = _csa(attn.compressor, hidden, q_residual, positions, store, req,
                                 layer)
        logits.append(torch.einsum("hld,lkd->hlk", q, entries))
        masks.append(selected)
        values.append(entries)
    elif kind == HCA:
        entries = _hca(attn.compressor, hidden, positions, store, req, layer)
        logits.append(torch.einsum("hld,kd->hlk", q, entries))
        ratio = attn.compressor.compress_rate
        visible = torch.arange(entries.shape[0], device=hidden.device)[None, :] < (
            (positions[:, None] + 1) // ratio)
        masks.append(visible)
        values.append(entries.expand(L, -1, -1))

    # transformers' eager attention, dtype for dtype: scores in the KV dtype, the softmax
    # in float32 beside the float32 sinks, probabilities back in the KV dtype for the
    # weighted sum (the float32 model is unchanged by these casts).
    scores = torch.cat([lg * attn.scaling for lg in logits], dim=-1)
    mask = torch.cat(masks, dim=-1)
    scores = scores.masked_fill(~mask[None], NEG_INF)
    sinks = attn.sinks.view(n_heads, 1, 1).expand(-1, L, 1)
    softmax_dtype = torch.promote_types(scores.dtype, sinks.dtype)
    combined = torch.cat([scores.to(softmax_dtype), sinks.to(softmax_dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]
    kv_values = torch.cat(values, dim=1)
    out = torch.einsum("hlk,lkd->lhd", probs.to(kv_values.dtype), kv_values)  # [L, H, hd]

    # K = V carried RoPE into the output's rope slice: rotate it back at the query position.
    out = apply_rotary_pos_emb(out.unsqueeze(0).transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = out.reshape(1, L, cfg.o_groups, -1)
    return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))[0]


def _state(req: RequestKV, layer: int, series: str, module: Any,
           like: torch.Tensor) -> CompressorState:
    key = (layer, series)
    if key not in req.states:
        req.states[key] = empty_state(module, like)
    return req.states[key]


def _emit(module: Any, series: str, pool: str, hidden: torch.Tensor,
          positions: torch.Tensor, store: PagedStorage, req: RequestKV, layer: int,
          overlap: bool, read_all: bool = True) -> tuple[torch.Tensor | None, int, int,
                                                         list[torch.Tensor]]:
    """Compress and write the new entries to `pool`. Returns (every entry so far when
    `read_all`, else None; first new window; entry count; overlaps)."""
    ratio = module.compress_rate
    state = _state(req, layer, series, module, hidden)
    first = int(positions[0]) - state.buffer_kv.shape[0]  # the unfinished window's start
    new, overlaps = compress(module, hidden, state, first, overlap)
    flat = store.flat(pool, layer)
    table = req.page_tables[pool]
    w0 = first // ratio
    if new.shape[0]:  # the pool may live in host memory (HiSparse's C4): write it there
        pos = (torch.arange(new.shape[0], device=hidden.device) + w0) * ratio
        flat[store.address(pool, table, pos).to(flat.device)] = new.to(flat.device)
    count = w0 + new.shape[0]
    if not read_all:
        return None, w0, count, overlaps
    every = torch.arange(count, device=hidden.device) * ratio
    return flat[store.address(pool, table, every)], w0, count, overlaps


def _hca(comp: Any, hidden: torch.Tensor, positions: torch.Tensor,
         store: PagedStorage, req: RequestKV, layer: int) -> torch.Tensor:
    entries, _, _, _ = _emit(comp, "compressor", "c128", hidden, positions, store, req, layer,
                             overlap=False)
    assert entries is not None
    return entries


def _csa(comp: Any, hidden: torch.Tensor, q_residual: torch.Tensor,
         positions: torch.Tensor, store: PagedStorage, req: RequestKV,
         layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """C4 entries selected per query by the indexer: ([L, k, hd], valid mask [L, k])."""
    ratio = comp.compress_rate
    _, w0, _, c4_overlaps = _emit(comp, "compressor", "c4", hidden, positions, store, req,
                                  layer, overlap=True, read_all=False)
    index = comp.indexer
    keys, _, _, idx_overlaps = _emit(index, "indexer", "c4_index", hidden, positions, store,
                                     req, layer, overlap=True)
    assert keys is not None
    _snapshot(store, req, layer, w0, ratio, c4_overlaps, idx_overlaps)

    L = hidden.shape[0]
    cos, sin = index.rotary_emb(hidden, position_ids=positions[None], layer_type="compress")
    q = index.q_b_proj(q_residual).view(1, L, -1, index.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [1, L, H_i, d_i]
    count = keys.shape[0]
    top_k = min(index.index_topk, count)
    threshold = (positions + 1) // ratio  # query t sees entry w only when w < threshold
    if count == 0:
        if req.topk is not None:
            req.topk.setdefault(layer, []).append((positions.new_zeros(0), 0))
        return hidden.new_zeros((L, 0, comp.head_dim)), torch.zeros(
            (L, 0), dtype=torch.bool, device=hidden.device)
    scores = index.scorer(q, keys[None], hidden[None])[0]  # [L, count]
    future = torch.arange(count, device=hidden.device)[None, :] >= threshold[:, None]
    picked = scores.masked_fill(future, NEG_INF).topk(top_k, dim=-1).indices  # [L, k]
    valid = picked < threshold[:, None]
    if req.topk is not None:  # the last row sees every entry so far: count is its threshold
        req.topk.setdefault(layer, []).append((picked[-1][valid[-1]], count))
    # A real sparse gather: only the k selected C4 entries per query are read.
    table = req.page_tables["c4"]
    flat = store.flat("c4", layer)
    if req.c4 is not None:  # HiSparse: from the request's hot buffer
        def address(ids: torch.Tensor) -> torch.Tensor:
            return store.address("c4", table, ids * ratio)

        return req.c4.read(layer, flat, address, picked, valid, count), valid
    safe = torch.where(valid, picked, torch.zeros_like(picked))
    return flat[store.address("c4", table, safe * ratio)], valid


def _snapshot(store: PagedStorage, req: RequestKV, layer: int, w0: int, ratio: int,
              c4: list[torch.Tensor], idx: list[torch.Tensor]) -> None:
    """Write the CSA overlap at every page end this chunk closed into the state pool."""
    if "state" not in req.page_tables or not c4:
        return
    per_page = store.layout.page_size // ratio
    table = req.page_tables["state"]
    ends = [(i, (w0 + i + 1) // per_page - 1) for i in range(len(c4))
            if (w0 + i + 1) % per_page == 0 and (w0 + i + 1) // per_page <= table.shape[0]]
    if not ends:
        return
    physical = table[[page for _, page in ends]].tolist()  # one read of the page table
    rows = [(i, p) for (i, _), p in zip(ends, physical, strict=True) if p >= 0]
    if rows:
        entries = torch.stack([torch.cat([c4[i], idx[i]], dim=-1) for i, _ in rows])
        store.flat("state", layer)[[p for _, p in rows]] = entries


def resume_states(store: PagedStorage, req: RequestKV, layer_types: list[str],
                  modules: list[Any], resume_pages: int,
                  like: torch.Tensor) -> None:
    """Load each CSA layer's overlap from the checkpoint at page `resume_pages`.

    Page ends are multiples of every compression ratio, so unfinished windows are
    empty there: HCA and sliding-window layers resume with nothing to load, and a
    model without CSA layers has no state pool at all.
    """
    if resume_pages == 0 or CSA not in layer_types:
        return
    page = int(req.page_tables["state"][resume_pages - 1])  # read once, not per layer
    for layer, kind in enumerate(layer_types):
        if kind != CSA:
            continue
        comp = modules[layer].compressor
        entry = store.flat("state", layer)[page]
        hd = comp.head_dim
        for series, module, cols in (("compressor", comp, slice(None, hd)),
                                     ("indexer", comp.indexer, slice(hd, None))):
            state = _state(req, layer, series, module, like)
            state.overlap_kv = entry[0, :, cols].clone()
            state.overlap_gate = entry[1, :, cols].clone()
