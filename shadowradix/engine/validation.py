"""Checks on what callers hand the engine: ValueError before any state changes."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral
from typing import Any

import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.layout import deepseek_v4
from shadowradix.layout.spec import KVLayout
from shadowradix.model.dtypes import kv_dtypes


def model_layout(hf_model: Any, page_size: int) -> KVLayout:
    """The pools a DeepSeek-V4 model needs, each in the dtype its KV form is computed in
    (a bfloat16 checkpoint keeps its compress state in float32: `kv_dtypes`).
    Raises ValueError for anything that is not a DeepSeek-V4 model."""
    cfg = getattr(hf_model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind != "deepseek_v4" or not isinstance(hf_model, torch.nn.Module) or not all(
            hasattr(hf_model, a) for a in ("model", "lm_head")):
        got = kind or type(hf_model).__name__
        raise ValueError(f"expected a DeepSeek-V4 causal LM (transformers' "
                         f"DeepseekV4ForCausalLM), got {got}")
    dtypes = {name: str(d).removeprefix("torch.") for name, d in kv_dtypes(hf_model).items()}
    return deepseek_v4(cfg, page_size, dtypes["swa"], dtypes=dtypes)


def check_batch(prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None,
                vocab_size: int) -> list[SamplingParams]:
    """The prompts and their sampling parameters, checked; one SamplingParams per prompt.
    Raises ValueError naming the first bad input; changes nothing."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token id lists")
    if not prompts:
        raise ValueError("prompts is empty")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence | torch.Tensor):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt)}")
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, Integral | torch.Tensor):
                raise ValueError(f"prompt {i}: token {t!r} is not an integer id")
            if not 0 <= int(t) < vocab_size:
                raise ValueError(f"prompt {i}: token id {int(t)} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    if params is None:
        return [SamplingParams()] * len(prompts)
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    plist = list(params)
    if len(plist) != len(prompts) or not all(isinstance(p, SamplingParams) for p in plist):
        raise ValueError("params must be one SamplingParams or one per prompt")
    return plist
