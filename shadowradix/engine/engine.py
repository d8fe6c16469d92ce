"""The public Engine: DeepSeek-V4 generation through ShadowRadix (DESIGN.md §7)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from shadowradix.engine.cache_control import CacheControl
from shadowradix.engine.config import CacheConfig, SamplingParams
from shadowradix.engine.request import Request, Result
from shadowradix.engine.sampling import sample
from shadowradix.engine.scheduler import Scheduler
from shadowradix.engine.validation import check_batch, model_layout
from shadowradix.model import DeepseekV4Runner, PagedStorage
from shadowradix.tiers.host_tier import HostTier
from shadowradix.tiers.mover import mover_for
from shadowradix.tiers.prefix_cache import PrefixCache
from shadowradix.tiers.storage import open_storage
from shadowradix.tiers.storage_tier import StorageTier


class Engine:
    """Runs a DeepSeek-V4 model with every KV form in ShadowRadix pools.

    generate() takes token id lists and returns Results whose logits equal
    transformers' uncached forward within float32 rounding, whatever the cache
    served. Bad input raises ValueError before any state changes.
    """

    def __init__(self, hf_model: Any, config: CacheConfig, step_tokens: int = 512) -> None:
        self.layout = model_layout(hf_model, config.page_size)
        cfg = hf_model.config
        self.device = next(hf_model.parameters()).device
        self.config = config
        self.vocab_size = int(cfg.vocab_size)
        eos = cfg.eos_token_id
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        host_pages = config.host_tokens // config.page_size if config.host_tokens else None
        self._prefix = PrefixCache(self.layout, config.device_tokens // config.page_size,
                                   device=self.device, host_pages=host_pages)
        pools = {name: pool.storage for name, pool in self._prefix.pools.items()}
        self.store = PagedStorage.for_layer_types(self.layout, pools,  # type: ignore[arg-type]
                                                  list(cfg.layer_types))
        self.runner = DeepseekV4Runner(hf_model.eval())
        self.storage = None
        if config.storage is not None:
            from shadowradix.model.fingerprint import model_fingerprint

            self.storage = StorageTier(open_storage(config.storage, config.storage_cap_bytes),
                                       self._prefix, model_fingerprint(hf_model))
        self.host = None
        if host_pages is not None:
            self.host = HostTier(self._prefix, mover_for(self._prefix.tensor, self.device),
                                 config.write_policy, config.write_hit_threshold)
        self.scheduler = Scheduler(self._prefix, step_tokens, self.device, self.storage,
                                   self.host)
        self.cache = CacheControl(self._prefix, self.storage)
        self._counters: dict[str, float] = {
            "requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_tokens": 0,
            "decode_tokens": 0, "steps": 0, "step_seconds": 0.0, "forward_seconds": 0.0,
            "host_tokens": 0, "storage_tokens": 0, "copy_stalls": 0, "copy_stall_seconds": 0.0}
        self._closed = False

    @classmethod
    def from_hf(cls, hf_model: Any, config: CacheConfig, **kwargs: Any) -> Engine:
        return cls(hf_model, config, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str, config: CacheConfig, dtype: torch.dtype = torch.float32,
                        device: str = "cpu", **kwargs: Any) -> Engine:
        """Load an HF-format checkpoint directory (config.json + safetensors)."""
        from transformers import DeepseekV4ForCausalLM

        model: Any = DeepseekV4ForCausalLM.from_pretrained(path, dtype=dtype)
        model = model.to(device)
        return cls(model, config, **kwargs)

    # -------------------------------------------------------------- generate
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_logits: bool = False) -> list[Result]:
        if self._closed:
            raise RuntimeError("engine is closed")
        plist = check_batch(prompts, params, self.vocab_size)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            gen = None if p.greedy else torch.Generator().manual_seed(p.seed)
            req = Request(i, [int(t) for t in prompt], len(prompt), p, gen)
            if not self.scheduler.fits_ever(req):
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + max_new_tokens {p.max_new_tokens} need "
                    f"{req.pages_needed(self.config.page_size)} pages; the device pools hold "
                    f"{self.config.device_tokens // self.config.page_size}")
            requests.append(req)
        self.scheduler.waiting.extend(requests)
        try:
            while any(not r.done for r in requests):
                self._step()
        except BaseException:
            self.scheduler.abort(requests)  # leave no lock or page behind (KeyboardInterrupt too)
            raise
        return [self._result(r, return_logits) for r in requests]

    def _step(self) -> None:
        t_step = time.perf_counter()
        sched = self.scheduler
        sched.admit()
        chunks = sched.plan()
        if not chunks:
            raise RuntimeError("no request can run: pools exhausted by locked pages")
        segments = []
        for c in chunks:
            assert c.request.kv is not None
            ids = torch.tensor(c.request.ids[c.start:c.end], device=self.device)
            if self.host is not None:
                self._wait_for_copies(c.request.ready)
            if c.start == c.request.cached and c.start:  # first chunk after a cache hit
                self.runner.resume(self.store, c.request.kv, c.start // self.config.page_size)
            segments.append((ids, c.start, c.request.kv))
        t_forward = time.perf_counter()
        outputs = self.runner.forward_batch(segments, self.store)
        self._counters["forward_seconds"] += time.perf_counter() - t_forward
        self._counters["steps"] += 1
        for c, logits in zip(chunks, outputs, strict=True):
            req = c.request
            decoding = not req.prefilling
            req.computed = c.end
            self._counters["decode_tokens" if decoding else "prefill_tokens"] += c.end - c.start
            if req.prefilling:
                continue
            row = logits[-1]
            token = sample(row, req.params, req.generator)
            req.logits.append(row.cpu())
            req.ids.append(token)
            if len(req.outputs) >= req.params.max_new_tokens or (
                    not req.params.ignore_eos and token in self.eos):
                req.done = True
                sched.finish(req)
        self._counters["step_seconds"] += time.perf_counter() - t_step

    def _wait_for_copies(self, ticket: int) -> None:
        """Its pages are back from the host before the forward reads them. A wait that
        finds the copy still running is a stall: counted, with the CPU seconds it cost
        (on CUDA the wait is on the stream, so the seconds stay near zero)."""
        assert self.host is not None
        mover = self.host.mover
        if mover.done(ticket):
            return
        t0 = time.perf_counter()
        mover.wait(ticket)
        self._counters["copy_stalls"] += 1
        self._counters["copy_stall_seconds"] += time.perf_counter() - t0

    def _result(self, req: Request, return_logits: bool) -> Result:
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += req.prompt_len
        self._counters["cached_tokens"] += req.cached
        logits = torch.stack(req.logits) if return_logits else None
        self._counters["host_tokens"] += req.from_host
        self._counters["storage_tokens"] += req.from_storage
        return Result(req.outputs, logits, req.cached,
                      {"device": req.cached - req.from_host - req.from_storage,
                       "host": req.from_host, "storage": req.from_storage})

    # ---------------------------------------------------------------- status
    def stats(self) -> dict[str, Any]:
        cache = self._prefix.stats()
        return {
            **self._counters,
            "hits": {"device": self._counters["cached_tokens"] - self._counters["host_tokens"]
                     - self._counters["storage_tokens"],
                     "host": self._counters["host_tokens"],
                     "storage": self._counters["storage_tokens"]},
            "host": {**self.host.counts, "bytes_moved": self.host.mover.bytes_moved}
            if self.host else {},
            "pools": cache["pools"],
            "nodes": cache["nodes"],
            "storage_errors": self.storage.errors if self.storage else 0,
            "storage_bytes": {"read": self.storage.bytes_read if self.storage else 0,
                              "written": self.storage.bytes_written if self.storage else 0},
            "hisparse": {"hits": 0, "misses": 0, "bytes_moved": 0},
        }

    def close(self) -> None:
        """Stop accepting work, finish the host copies and the storage reads and writes
        in flight, and close the storage backend."""
        self._closed = True
        if self.host is not None:
            self.host.mover.close()
        if self.storage is not None:
            self.storage.close()
