"""Tiny random DeepSeek-V4 models that stay faithful to the real one (DESIGN.md §1).

Nothing is downloaded: `transformers` builds the model from a config. HF's random
init zeroes the attention sinks, the compressors' position biases and the
hash-routing table, which would hide addressing bugs, so they are randomised;
at least 16 indexer heads keep top-k free of ties.
"""

from __future__ import annotations

from typing import Any

CSA, HCA, SWA = ("compressed_sparse_attention", "heavily_compressed_attention",
                 "sliding_attention")


def tiny_config(**overrides: Any) -> Any:
    """The DeepseekV4Config of `tiny_deepseek_v4` (no weights built)."""
    from transformers import DeepseekV4Config

    settings: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=16,
        index_head_dim=16, index_topk=4, sliding_window=8,
        compress_rates={CSA: 4, HCA: 16}, layer_types=[SWA, CSA, HCA, CSA],
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2,
        max_position_embeddings=65536, partial_rotary_factor=0.25)
    settings.update(overrides)
    settings["num_hidden_layers"] = len(settings["layer_types"])
    return DeepseekV4Config(**settings)


def tiny_deepseek_v4(seed: int = 0, **overrides: Any) -> Any:
    """A float32 `DeepseekV4ForCausalLM` in eval mode; `overrides` go to DeepseekV4Config."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "sinks"):
                module.sinks.normal_()
            if hasattr(module, "position_bias"):
                module.position_bias.normal_()
            if hasattr(module, "tid2eid"):
                module.tid2eid.copy_(torch.randint(0, config.n_routed_experts,
                                                   module.tid2eid.shape))
    return model
