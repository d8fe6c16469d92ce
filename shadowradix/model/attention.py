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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from shadowradix.model.compressor import Journal, compress, empty_state
from shadowradix.model.context import CompressorState, PagedStorage, RequestKV

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
NEG_INF = float("-inf")


@dataclass
class _Keys:
    """What one request's queries attend to in one layer: key blocks, each with its mask
    `[L, K]` and values `[K, hd]` shared by every row or `[L, K, hd]` per row."""

    blocks: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    c4: _Selection | None = None  # CSA: the C4 entries still to fetch


@dataclass
class _Selection:
    """The indexer's top-k per query `[L, k]`, the request's entry count, and the physical
    address of any of its logical C4 entries."""

    picked: torch.Tensor
    valid: torch.Tensor
    count: int
    address: Callable[[torch.Tensor], torch.Tensor]


def attention_layer(attn: Any, hidden: torch.Tensor, positions: torch.Tensor,
                    bounds: Sequence[tuple[int, int]], rope: tuple[torch.Tensor, torch.Tensor],
                    store: PagedStorage, requests: Sequence[RequestKV]) -> torch.Tensor:
    """One attention layer for every request of a step: hidden [T, hidden] at `positions`,
    request i owning rows bounds[i] (consecutive positions) -> output [T, hidden].

    Per-token projections run once over all T rows; keys are written and gathered per
    request over its own page tables; the step's C4 reads are fetched together (with
    HiSparse, one batched host -> device copy per layer)."""
    layer, kind = attn.layer_idx, attn.layer_type
    cfg = attn.config
    n_heads, hd = attn.num_heads, attn.head_dim
    cos, sin = rope
    T = hidden.shape[0]

    q_residual = attn.q_a_norm(attn.q_a_proj(hidden))
    q = attn.q_b_norm(attn.q_b_proj(q_residual).view(1, T, n_heads, hd).transpose(1, 2))
    q = apply_rotary_pos_emb(q, cos, sin)[0]  # [H, T, hd]
    kv = attn.kv_norm(attn.kv_proj(hidden)).view(1, T, 1, hd).transpose(1, 2)
    kv = apply_rotary_pos_emb(kv, cos, sin)[0, 0]  # [T, hd]

    keys = []
    for (a, b), req in zip(bounds, requests, strict=True):
        k = _Keys([_window(attn, kv[a:b], positions[a:b], store, req)])
        if kind == CSA:
            k.c4 = _csa(attn.compressor, hidden[a:b], q_residual[a:b], positions[a:b], store,
                        req, layer)
        elif kind == HCA:
            k.blocks.append(_hca(attn.compressor, hidden[a:b], positions[a:b], store, req,
                                 layer))
        keys.append(k)
    if kind == CSA:
        _fetch_c4(store, layer, requests, keys)
    out = torch.cat([_attend(attn, q[:, a:b], k) for (a, b), k in zip(bounds, keys,
                                                                       strict=True)])
    # K = V carried RoPE into the output's rope slice: rotate it back at the query position.
    out = apply_rotary_pos_emb(out.unsqueeze(0).transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = out.reshape(1, T, cfg.o_groups, -1)
    return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))[0]


def _window(attn: Any, kv: torch.Tensor, positions: torch.Tensor, store: PagedStorage,
            req: RequestKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Sliding window: write this chunk, read back [start - W + 1, end)."""
    swa = store.flat("swa", attn.layer_idx)
    table = req.page_tables["swa"]
    swa[store.address("swa", table, positions)] = kv
    window = attn.sliding_window
    start, end = int(positions[0]), int(positions[-1]) + 1
    kpos = torch.arange(max(start - window + 1, 0), end, device=kv.device)
    visible = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] > positions[:, None] - window)
    return visible, swa[store.address("swa", table, kpos)]


def _attend(attn: Any, q: torch.Tensor, keys: _Keys) -> torch.Tensor:
    """q [H, L, hd] over the request's key blocks -> [L, H, hd].

    transformers' eager attention, dtype for dtype: scores in the KV dtype, the softmax in
    float32 beside the float32 sinks, probabilities back in the KV dtype for the weighted
    sum (the float32 model is unchanged by these casts)."""
    L = q.shape[1]
    logits, values = [], []
    for _, block in keys.blocks:
        per_row = block.dim() == 3
        logits.append(torch.einsum("hld,lkd->hlk" if per_row else "hld,kd->hlk", q, block))
        values.append(block if per_row else block.expand(L, -1, -1))
    scores = torch.cat([lg * attn.scaling for lg in logits], dim=-1)
    mask = torch.cat([m for m, _ in keys.blocks], dim=-1)
    scores = scores.masked_fill(~mask[None], NEG_INF)
    sinks = attn.sinks.view(attn.num_heads, 1, 1).expand(-1, L, 1)
    softmax_dtype = torch.promote_types(scores.dtype, sinks.dtype)
    combined = torch.cat([scores.to(softmax_dtype), sinks.to(softmax_dtype)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = combined.softmax(dim=-1)[..., :-1]
    kv_values = torch.cat(values, dim=1)
    return torch.einsum("hlk,lkd->lhd", probs.to(kv_values.dtype), kv_values)


def _fetch_c4(store: PagedStorage, layer: int, requests: Sequence[RequestKV],
              keys: list[_Keys]) -> None:
    """Read every request's selected C4 entries: straight from the pool, or through the
    requests' C4 readers (HiSparse), whose plans are served in one fetch."""
    flat = store.flat("c4", layer)
    plans, planned = [], []
    for req, k in zip(requests, keys, strict=True):
        sel = k.c4
        assert sel is not None
        if sel.count == 0:
            k.blocks.append((sel.valid, flat.new_zeros((*sel.picked.shape, flat.shape[-1]))))
        elif req.c4 is not None:
            plans.append(req.c4.plan(layer, sel.address, sel.picked, sel.valid, sel.count))
            planned.append(k)
        else:  # a real sparse gather: only the k selected entries per query are read
            safe = torch.where(sel.valid, sel.picked, torch.zeros_like(sel.picked))
            k.blocks.append((sel.valid, flat[sel.address(safe)]))
    if plans:
        reader = next(r.c4 for r in requests if r.c4 is not None)
        for k, entries in zip(planned, reader.fetch(layer, flat, plans), strict=True):
            assert k.c4 is not None
            k.blocks.append((k.c4.valid, entries))


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
    journal = None
    if req.journal is not None:
        journal = req.journal[(layer, series)] = Journal()
    new, overlaps = compress(module, hidden, state, first, overlap, journal)
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
         store: PagedStorage, req: RequestKV, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every C128 entry so far, and which each query sees: (mask [L, C], entries [C, hd])."""
    entries, _, _, _ = _emit(comp, "compressor", "c128", hidden, positions, store, req, layer,
                             overlap=False)
    assert entries is not None
    visible = torch.arange(entries.shape[0], device=hidden.device)[None, :] < (
        (positions[:, None] + 1) // comp.compress_rate)
    return visible, entries


def _csa(comp: Any, hidden: torch.Tensor, q_residual: torch.Tensor,
         positions: torch.Tensor, store: PagedStorage, req: RequestKV,
         layer: int) -> _Selection:
    """Write the chunk's C4 entries and indexer keys; the indexer's top-k per query."""
    ratio = comp.compress_rate
    _, w0, _, c4_overlaps = _emit(comp, "compressor", "c4", hidden, positions, store, req,
                                  layer, overlap=True, read_all=False)
    index = comp.indexer
    keys, _, _, idx_overlaps = _emit(index, "indexer", "c4_index", hidden, positions, store,
                                     req, layer, overlap=True)
    assert keys is not None
    _snapshot(store, req, layer, w0, ratio, c4_overlaps, idx_overlaps)
    table = req.page_tables["c4"]

    def address(ids: torch.Tensor) -> torch.Tensor:
        return store.address("c4", table, ids * ratio)

    L = hidden.shape[0]
    count = keys.shape[0]
    if count == 0:
        if req.topk is not None:
            rows = L if req.journal is not None else 1
            req.topk.setdefault(layer, []).extend([(positions.new_zeros(0), 0)] * rows)
        none = positions.new_zeros((L, 0))
        return _Selection(none, none.bool(), 0, address)
    cos, sin = index.rotary_emb(hidden, position_ids=positions[None], layer_type="compress")
    q = index.q_b_proj(q_residual).view(1, L, -1, index.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)  # [1, L, H_i, d_i]
    threshold = (positions + 1) // ratio  # query t sees entry w only when w < threshold
    scores = index.scorer(q, keys[None], hidden[None])[0]  # [L, count]
    future = torch.arange(count, device=hidden.device)[None, :] >= threshold[:, None]
    top_k = min(index.index_topk, count)
    picked = scores.masked_fill(future, NEG_INF).topk(top_k, dim=-1).indices  # [L, k]
    valid = picked < threshold[:, None]
    if req.topk is not None:  # the last row sees every entry so far: count is its threshold
        log = req.topk.setdefault(layer, [])
        if req.journal is not None:  # a speculative step: every row is a decode query
            log.extend((picked[i][valid[i]], int(threshold[i])) for i in range(L))
        else:
            log.append((picked[-1][valid[-1]], count))
    return _Selection(picked, valid, count, address)


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
        store.flat("state", layer)[[store.page_entry("state", p) for _, p in rows]] = entries


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
    page = int(store.page_entry("state", int(req.page_tables["state"][resume_pages - 1])))
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
