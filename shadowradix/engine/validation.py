"""Checks on what callers hand the engine: ValueError before any state changes."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shadowradix.engine.config import SamplingParams
from shadowradix.layout import deepseek_v4
from shadowradix.layout.spec import KVLayout
from shadowradix.model.dtypes import kv_dtypes


def model_layout(hf_model: Any, page_size: int, extra_layers: Sequence[str] = ()) -> KVLayout:
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
    return deepseek_v4(cfg, page_size, dtypes["swa"], dtypes=dtypes, extra_layers=extra_layers)


def check_batch(prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None,
                vocab_size: int) -> list[SamplingParams]:
    """The prompts and their sampling parameters, checked; one SamplingParams per prompt.
    Raises ValueError naming the first bad input; changes nothing."""
    return checked_batch(prompts, params, vocab_size)[1]


def checked_batch(prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams] | None,
                  vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """As `check_batch`, also returning each prompt as a list of Python ints (converted
    once, here)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of token id lists")
    if not prompts:
        raise ValueError("prompts is empty")
    id_lists = []
    for i, prompt in enumerate(prompts):
        ids = _token_ids(i, prompt)
        for t in ids:
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i}: token id {t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        id_lists.append(ids)
    if params is None:
        return id_lists, [SamplingParams()] * len(prompts)
    if isinstance(params, SamplingParams):
        plist = [params] * len(prompts)
    else:
        plist = list(params)
        if len(plist) != len(prompts) or not all(isinstance(p, SamplingParams) for p in plist):
            raise ValueError("params must be one SamplingParams or one per prompt")
    for p in plist:
        for t in p.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids: token id {t} is outside the vocabulary "
                                 f"[0, {vocab_size})")
    return id_lists, plist


def _token_ids(i: int, prompt: Any) -> list[int]:
    """The prompt's ids, if it is a list of ints (numpy integers and 0-d integer tensors
    included), or a 1-d integer numpy array or torch tensor. Floats are refused, never
    truncated: 2.9 is no token id."""
    if isinstance(prompt, torch.Tensor | np.ndarray):
        kind = str(prompt.dtype).removeprefix("torch.")
        if prompt.ndim != 1 or not _integer_dtype(prompt.dtype):
            raise ValueError(f"prompt {i} must be a 1-d array of integer token ids, got "
                             f"{prompt.ndim}-d {kind}")
        ids = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
        for t in prompt:
            if not _is_token(t):
                raise ValueError(f"prompt {i}: token {t!r} is not an integer id")
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt)}")
    if not ids:
        raise ValueError(f"prompt {i} is empty")
    return ids


def _is_token(t: Any) -> bool:
    """A Python or numpy integer (not a bool), or a 0-d integer tensor or array."""
    if isinstance(t, torch.Tensor | np.ndarray):
        return t.ndim == 0 and _integer_dtype(t.dtype)
    return isinstance(t, Integral) and not isinstance(t, bool | np.bool_)


def _integer_dtype(dtype: Any) -> bool:
    """Integer, not bool, for numpy and torch dtypes alike."""
    if isinstance(dtype, torch.dtype):
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
    return bool(np.issubdtype(dtype, np.integer))


# What one setting (or a few together) asks memory for: a label naming it and its value,
# the bytes, and the settings a smaller value of which would shrink it.
Part = tuple[str, int, tuple[str, ...]]


def memory_bytes(device: torch.device) -> int | None:
    """The memory `device` has: a CUDA device's total; for the CPU, this machine's RAM or
    the control group's limit where lower (a container); None where unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        ram: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        ram = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            ram = int(text) if ram is None else min(ram, int(text))
        break
    return ram


def check_memory(device: torch.device, on_device: Sequence[Part],
                 in_host: Sequence[Part]) -> None:
    """ValueError, before anything is allocated, when the cache's tensors take more memory
    than there is: `on_device` on `device` (its pools or arena and HiSparse's hot buffers)
    and `in_host` in this machine's memory (the host tier and the pools kept in host
    memory; on a CPU device both share it). The message names the parts, largest first (but
    those under 1% of the need), and the settings that would shrink them."""
    if device.type == "cpu":
        on_device, in_host = (), [*on_device, *in_host]
    for parts, where, has in ((on_device, str(device), memory_bytes(device)),
                              (in_host, "this machine's memory",
                               memory_bytes(torch.device("cpu")))):
        need = sum(b for _, b, _ in parts)
        if has is None or need <= has:
            continue
        parts = sorted(parts, key=lambda p: -p[1])
        parts = [p for p in parts if p[1] >= need / 100] or parts[:1]
        knobs = list(dict.fromkeys(k for _, _, ks in parts for k in ks))
        smaller = ", ".join(knobs[:-1]) + (" or " if len(knobs) > 1 else "") + knobs[-1]
        raise ValueError(f"the KV cache needs {_gib(need)} of {where}, which has {_gib(has)}: "
                         + ", ".join(f"{label}: {_gib(b)}" for label, b, _ in parts)
                         + f"; give a smaller {smaller}")


@contextmanager
def allocating(sizing: str) -> Iterator[None]:
    """Turn an allocation that fails (numpy's MemoryError, torch's allocator errors, CUDA
    out of memory) into a ValueError naming `sizing`, the settings that sized it."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower():
            raise
        raise ValueError(f"could not allocate the KV cache ({sizing}): {e}") from None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"
