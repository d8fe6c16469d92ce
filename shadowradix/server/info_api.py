"""What SGLang's router (`sglang-router`, the Rust "model gateway") asks a worker, in
SGLang's response shapes, so shadowradix servers can stand behind it unchanged.

Observed with sglang-router 0.3.2 against a live server: when a worker is added the
router probes `GET /health` (no API key), then `GET /server_info` and `GET /model_info`
(falling back to the deprecated `/get_server_info` and `/get_model_info`, which older
SGLang workers serve); `GET /get_load` feeds its `/get_loads` (it sums `num_tokens` over
the list) and the power-of-two policy. It sends `Authorization: Bearer KEY` to all but
`/health` when started with `--api-key KEY`, so these routes sit behind the same key as
the rest. It takes the worker's model id from `served_model_name` and tries to load a
tokenizer from `tokenizer_path` or `model_path` (a warning if it cannot: HTTP routing,
cache-aware included, works on the request text and does not need one).

The settings are the engine's, taken once when it is built (they never change); the load is
the engine loop's last published snapshot, so none of this waits for a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from shadowradix import __version__
from shadowradix.server.runtime import Runtime
from shadowradix.tiers.storage.urls import redact


async def model_info(request: Request) -> JSONResponse:
    """SGLang's `/model_info`: where the model and its tokenizer come from."""
    rt: Runtime = request.app.state.runtime
    return JSONResponse(_model_info(rt, rt.settings))


async def server_info(request: Request) -> JSONResponse:
    """SGLang's `/server_info`: the server's settings (SGLang's names where one means
    the same), never the API key, and the storage URL without its credentials."""
    rt: Runtime = request.app.state.runtime
    return JSONResponse({**_model_info(rt, rt.settings), **rt.settings,
                         "served_model_name": rt.model_name, "context_length": rt.max_len,
                         "max_queued_requests": rt.loop.max_queue, "tp_size": 1, "dp_size": 1,
                         "disaggregation_mode": "null", "version": __version__})


async def get_load(request: Request) -> JSONResponse:
    """SGLang's `/get_load`: one entry per data-parallel rank (here always one)."""
    load = request.app.state.runtime.loop.load
    return JSONResponse([{"dp_rank": 0, "num_reqs": load.running + load.waiting,
                          "num_waiting_reqs": load.waiting, "num_tokens": load.tokens}])


# Both names: the router asks for the first and falls back to the second.
ROUTES = (("/model_info", model_info), ("/get_model_info", model_info),
          ("/server_info", server_info), ("/get_server_info", server_info),
          ("/get_load", get_load))


def _model_info(rt: Runtime, engine: dict[str, Any]) -> dict[str, Any]:
    # A tokenizer path only where there is one on disk: "tiny" is no Hugging Face repo.
    local = rt.root != "tiny" and Path(rt.root).is_dir()
    return {"model_path": rt.root, "tokenizer_path": rt.root if local else None,
            "is_generation": True, "model_type": engine["model_type"],
            "architectures": engine["architectures"], "has_image_understanding": False,
            "has_audio_understanding": False}


def engine_settings(engine: Any) -> dict[str, Any]:
    """The cache configuration and the model's identity (taken on the engine thread, once
    the engine is built)."""
    c, hf = engine.config, engine.runner.config
    return {"model_type": getattr(hf, "model_type", None),
            "architectures": getattr(hf, "architectures", None),
            "page_size": c.page_size, "max_total_num_tokens": engine.kv_tokens(),
            "device_bytes": engine.device_bytes,
            "arena": engine.arena_info(),
            "window_tokens": c.window_tokens, "state_tokens": c.state_tokens,
            "host_tokens": c.host_tokens,
            "hicache_write_policy": c.write_policy, "storage": redact(c.storage),
            "storage_authenticated": c.storage_secret is not None,
            "disable_radix_cache": not c.prefix_reuse, "cache_policy": c.policy,
            "hisparse_buffer": c.hisparse_buffer,
            "hisparse_requests": engine.hot.requests if engine.hot is not None else None,
            "chunked_prefill_size": engine.scheduler.step_tokens,
            "kv_pools": [p.name for p in engine.layout.pools], "device": str(engine.device),
            **spec_settings(engine.speculator.config)}


def spec_settings(spec: Any) -> dict[str, Any]:
    """Speculative decoding as the engine was given it (a SpecConfig, or None: off), under
    SGLang's server_args names; every one is None when it is off, the window when not
    ngram."""
    ngram = spec is not None and spec.method == "ngram"
    return {"speculative_algorithm": spec.method if spec is not None else None,
            "speculative_num_draft_tokens": spec.num_draft_tokens if spec is not None else None,
            "speculative_ngram_min_match_window_size": spec.ngram_min if ngram else None,
            "speculative_ngram_max_match_window_size": spec.ngram_max if ngram else None}
