"""A cheap content fingerprint of a model, for the L3 namespace (DESIGN.md §5).

Two engines may share stored KV only if their models compute the same KV: same config
(hidden size, layer order, index_topk, RoPE scaling, ...) and same weights. Hashing a
600 GB checkpoint whole would take minutes, so the fingerprint covers:

- the config, as JSON with sorted keys, less bookkeeping fields (`_name_or_path`,
  `transformers_version`, `use_cache`, output switches, other `_`-prefixed keys) that do
  not change the KV;
- every parameter and buffer: name, shape, dtype, and a strided sample of at most
  `SAMPLES` elements (first and last included) of its bytes.

Any retraining or fine-tune changes every sampled tensor; an edit confined to elements
no sample touches (a few weights of a large matrix) is not seen.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash

SAMPLES = 1024  # elements sampled per tensor: ~2 KiB of bf16, read wherever the tensor is
# Config fields that never change the KV: bookkeeping and per-call output switches.
_NOT_KV = {"transformers_version", "use_cache", "return_dict", "output_attentions",
           "output_hidden_states", "output_router_logits"}
_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def model_fingerprint(hf_model: Any, *more: Any) -> str:
    """A 128-bit hex digest of `hf_model`'s config and weights (see the module docstring),
    and of each module in `more` (an MTP block, whose KV the pages also hold). Reads at
    most SAMPLES elements of each tensor; does not change the model."""
    h = xxhash.xxh3_128()
    for i, model in enumerate((hf_model, *more)):
        if i:
            h.update(f"\n--- module {i}\n".encode())
        h.update(_config_text(model.config).encode())
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        names = sorted(tensors)
        samples = _gather([_sample(tensors[name].detach()) for name in names])
        for name, sample in zip(names, samples, strict=True):
            t = tensors[name]
            h.update(f"\n{name}:{tuple(t.shape)}:{t.dtype}:".encode())
            h.update(sample)
    return h.hexdigest()


def _config_text(config: Any) -> str:
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    kept = {k: v for k, v in data.items() if not k.startswith("_") and k not in _NOT_KV}
    return json.dumps(kept, sort_keys=True, default=str)


def _gather(samples: list[torch.Tensor]) -> list[bytes]:
    """Each sample's bytes, with one device-to-host copy per device (not one per tensor:
    a large MoE checkpoint has tens of thousands of tensors)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(samples):
        by_device.setdefault(s.device, []).append(i)
    out: list[bytes] = [b""] * len(samples)
    for members in by_device.values():
        data = torch.cat([samples[i] for i in members]).cpu().numpy().tobytes()
        pos = 0
        for i in members:
            out[i] = data[pos:pos + samples[i].numel()]
            pos += samples[i].numel()
    return out


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Up to SAMPLES evenly spaced elements of `t`, as raw bytes (uint8), on its device.
    Integer views let one indexing path serve every dtype (fp8 included)."""
    if t.is_meta or t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    flat = t.reshape(-1)
    as_int = _AS_INT.get(flat.element_size())
    if as_int is None:  # e.g. complex128: sample its bytes instead of its elements
        flat, as_int = flat.contiguous().view(torch.uint8), torch.uint8
    flat = flat.contiguous().view(as_int)
    n = flat.numel()
    k = min(n, SAMPLES)
    idx = torch.arange(k, device=flat.device, dtype=torch.int64) * (n - 1) // max(k - 1, 1)
    return flat[idx].view(torch.uint8)
