"""Tiny random DeepSeek-V4 models that stay faithful (DESIGN.md §1) and a driver that
runs requests through the tree and pools, for differential tests against transformers."""

from __future__ import annotations

import numpy as np
import torch

from shadowradix.layout import deepseek_v4
from shadowradix.model import DeepseekV4Runner, PagedStorage, RequestKV
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4
from shadowradix.tiers import PrefixCache


def tiny_model(layer_types: list[str] | None = None, window: int = 8, hca_ratio: int = 16,
               seed: int = 0):
    return tiny_deepseek_v4(seed, layer_types=layer_types or [SWA, CSA, HCA, CSA],
                            sliding_window=window, compress_rates={CSA: 4, HCA: hca_ratio})


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' uncached forward over the whole sequence: the ground truth."""
    return model(torch.tensor([tokens])).logits[0].float()


class Driver:
    """match -> lock -> allocate -> prefill in chunks -> insert -> unlock, on real storage."""

    def __init__(self, model, page_size: int = 16, pages: int = 64) -> None:
        self.model = model
        self.layout = deepseek_v4(model.config, page_size=page_size, dtype="float32")
        self.cache = PrefixCache(self.layout, pages, device="cpu")
        pools = {name: pool.storage for name, pool in self.cache.pools.items()}
        self.store = PagedStorage.for_layer_types(self.layout, pools,  # type: ignore[arg-type]
                                                  list(model.config.layer_types))
        self.runner = DeepseekV4Runner(model)

    def run(self, tokens: list[int], chunks: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """Logits for positions [cached, len) and the cached length."""
        ps = self.layout.page_size
        cache = self.cache
        m = cache.match(tokens)
        handle = cache.lock(m)
        done, full, total = m.prefix_len // ps, len(tokens) // ps, -(-len(tokens) // ps)
        got = cache.alloc({p.name: (full if p.ratio is None else total) - done
                           for p in self.layout.pools})
        assert got is not None, "pools too small"
        tables = {}
        for row, spec in enumerate(self.layout.pools):
            table = np.full(total, -1, dtype=np.int64)
            table[:done] = m.page_table[row]
            table[done:done + got[spec.name].size] = got[spec.name]
            tables[spec.name] = torch.from_numpy(table)
        req = RequestKV(tables)
        self.runner.resume(self.store, req, done)
        pos, outs = m.prefix_len, []
        for size in chunks or [len(tokens)]:
            if pos >= len(tokens):
                break
            end = min(pos + size, len(tokens))
            outs.append(self.runner.forward(torch.tensor(tokens[pos:end]), pos, self.store, req))
            pos = end
        if pos < len(tokens):
            outs.append(self.runner.forward(torch.tensor(tokens[pos:]), pos, self.store, req))
        own = np.stack([tables[p.name][done:full].numpy().astype(np.int32)
                        for p in self.layout.pools])
        cache.insert(tokens, own, done)
        cache.free({p.name: tables[p.name][full:].numpy().astype(np.int32)
                    for p in self.layout.pools if p.ratio is not None and total > full})
        cache.unlock(handle)
        return torch.cat(outs), m.prefix_len
