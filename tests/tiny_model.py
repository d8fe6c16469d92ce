"""Tiny random DeepSeek-V4 models that stay faithful (DESIGN.md §1) and a driver that
runs requests through the CacheManager, for differential tests against transformers."""

from __future__ import annotations

import numpy as np
import torch

from shadowradix.layout import deepseek_v4
from shadowradix.model import DeepseekV4Runner, PagedStorage, RequestKV
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4
from shadowradix.tiers import PrefixCache
from shadowradix.tiers.manager import CacheManager


def tiny_model(layer_types: list[str] | None = None, window: int = 8, hca_ratio: int = 16,
               seed: int = 0):
    return tiny_deepseek_v4(seed, layer_types=layer_types or [SWA, CSA, HCA, CSA],
                            sliding_window=window, compress_rates={CSA: 4, HCA: hca_ratio})


@torch.no_grad()
def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' uncached forward over the whole sequence, on the model's device: the
    ground truth."""
    return model(torch.tensor([tokens], device=model.device)).logits[0].float()


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens: one full uncached forward per token."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


class Driver:
    """A request's life through the CacheManager on real storage: admit, then per chunk grow,
    forward and cache the computed prefix (the window it left joins the tree), then finish."""

    def __init__(self, model, page_size: int = 16, pages: int = 64) -> None:
        self.model = model
        self.layout = deepseek_v4(model.config, page_size=page_size, dtype="float32")
        self.cache = PrefixCache(self.layout, pages, device="cpu")
        self.manager = CacheManager(self.cache, poison=True)
        pools = {name: pool.storage for name, pool in self.cache.pools.items()}
        self.store = PagedStorage.for_layer_types(self.layout, pools,  # type: ignore[arg-type]
                                                  list(model.config.layer_types))
        self.runner = DeepseekV4Runner(model)

    def run(self, tokens: list[int], chunks: list[int] | None = None) -> tuple[torch.Tensor, int]:
        """Logits for positions [cached, len) and the cached length."""
        sizes = list(chunks or [len(tokens)])
        arr = np.asarray(tokens, dtype=np.int32)
        lease = self.manager.admit(arr, sizes[0])
        assert lease is not None, "pools too small"
        req = RequestKV({})
        pos, outs, first = lease.cached, [], True
        while pos < len(tokens):
            end = min(pos + (sizes.pop(0) if sizes else len(tokens)), len(tokens))
            assert self.manager.grow(lease, end), "pools too small"
            req.page_tables = {name: torch.from_numpy(lease.table[row].astype(np.int64))
                               for row, name in enumerate(self.layout.pool_names)}
            if first:
                self.runner.resume(self.store, req, lease.cached // self.layout.page_size)
                first = False
            outs.append(self.runner.forward(torch.tensor(tokens[pos:end]), pos, self.store, req))
            pos = end
            if pos < len(tokens):
                self.manager.cache_prefix(lease, arr, pos)
        self.manager.finish(lease, arr, len(tokens))
        return torch.cat(outs), lease.cached
