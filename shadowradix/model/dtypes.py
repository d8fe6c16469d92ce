"""The dtype each KV form is computed in, so each pool stores exactly what the forward writes.

transformers keeps some DeepSeek-V4 parameters in float32 whatever the checkpoint's
dtype (`_keep_in_fp32_modules_strict`: norms, sinks, mHC, the compressors'
`position_bias`), so one model dtype is not enough. In a bfloat16 model:

    swa, c4, c4_index, c128   bfloat16: kv_norm returns its input's dtype, the
                              projection's output (as in transformers' cache)
    state                     float32: the overlap's gate rows are the gate
                              projection plus the float32 `position_bias`
                              (transformers' `overlap_gate`); its kv rows are
                              bfloat16 values, exact in float32
"""

from __future__ import annotations

from typing import Any

import torch

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def kv_dtypes(hf_model: Any) -> dict[str, torch.dtype]:
    """Pool name -> dtype of what the forward writes there, for the pools the model has.
    Reads parameter dtypes only; changes nothing."""
    layers = hf_model.model.layers
    types = list(hf_model.config.layer_types)
    out = {"swa": layers[0].self_attn.kv_proj.weight.dtype}
    if CSA in types:
        comp = layers[types.index(CSA)].self_attn.compressor
        out["c4"] = comp.kv_proj.weight.dtype
        out["c4_index"] = comp.indexer.kv_proj.weight.dtype
        out["state"] = _promote(comp.kv_proj.weight, comp.gate_proj.weight, comp.position_bias,
                                comp.indexer.kv_proj.weight, comp.indexer.gate_proj.weight,
                                comp.indexer.position_bias)
    if HCA in types:
        out["c128"] = layers[types.index(HCA)].self_attn.compressor.kv_proj.weight.dtype
    return out


def _promote(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype
