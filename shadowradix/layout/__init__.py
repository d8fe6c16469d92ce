"""Layouts: what one token becomes in each physical pool (no torch, no tree)."""

from shadowradix.layout.presets import (
    LAYOUT_NAMES,
    deepseek_v4,
    deepseek_v4_flash,
    deepseek_v4_pro,
    full_attention,
    hybrid_swa,
    named_layout,
    sliding_window,
    state_space,
)
from shadowradix.layout.spec import DTYPE_BYTES, KVLayout, PoolSpec, Retention

__all__ = [
    "DTYPE_BYTES",
    "LAYOUT_NAMES",
    "KVLayout",
    "PoolSpec",
    "Retention",
    "deepseek_v4",
    "deepseek_v4_flash",
    "deepseek_v4_pro",
    "full_attention",
    "hybrid_swa",
    "named_layout",
    "sliding_window",
    "state_space",
]
