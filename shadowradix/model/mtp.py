"""DeepSeek-V4's multi-token-prediction (MTP) block, built from transformers' own modules.

transformers' `DeepseekV4ForCausalLM` drops the checkpoint's `mtp.*` tensors; this module
builds the block they belong to, loads and saves them, and runs it uncached as the ground
truth for a paged (speculative-decoding) forward. Facts, from DeepSeek's reference
`inference/model.py` (`MTPBlock`, `Block`, `Gate`, `Attention`), SGLang's
`deepseek_v4_nextn.py` and vLLM's `deepseek_v4_mtp.py`:

- Input at position i: the trunk's hc-expanded hidden `h_i` [hc, D], the output of the
  last decoder layer *before* the trunk's `hc_head` and `norm`, and the embedding of the
  next token `t_{i+1}` (the trunk's own `embed_tokens`). It predicts `t_{i+2}`, at the
  trunk's position i (same RoPE position, same KV slot index).
- Combine: `e_proj(enorm(embed(t_{i+1})))` broadcast over the hc streams, plus
  `h_proj(hnorm(h_i))` applied to each stream; separate `e_proj` / `h_proj` (no V3-style
  `eh_proj`), both `Linear(D, D)` without bias.
- One full decoder layer (mHC attention + MoE), `layer_id = num_hidden_layers`: its
  compress ratio is `compress_ratios[num_hidden_layers] = 0` (sliding window only; SGLang
  hard-codes `COMPRESS_RATIO_NEXTN_LAYER = 0`), its MoE is routed top-k with the score
  correction bias (hash routing is `layer_id < n_hash_layers`).
- Head: the block's own `hc_head` (fn/base/scale) and final `norm`, then the trunk's shared
  `lm_head`: logits = lm_head(norm(hc_head(h))).

A layer forward is exactly these transformers sub-calls (what `DeepseekV4Runner` does for
the trunk, and what `layer_forward` below does with any attention):

    post, comb, x = layer.attn_hc(h)                       # h [B, S, hc, D]
    a = attention(layer.input_layernorm(x))                # [B, S, D]; self_attn in HF
    h = post * a (broadcast over hc) + comb^T @ h
    post, comb, x = layer.ffn_hc(h)
    m = layer.mlp(layer.post_attention_layernorm(x), input_ids=next_ids)
    h = post * m + comb^T @ h

Checkpoint names are the real checkpoint's (`mtp.0.attn.wq_a.weight`, `mtp.0.ffn.experts.3.w1
.weight`, `mtp.0.hc_head_fn`, ...; see `_NAMES`), so a DeepSeek-V4 checkpoint's unquantized
`mtp.0.*` tensors load here; FP8/FP4 tensors (with `.scale`) are refused.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4DecoderLayer,
    DeepseekV4Experts,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4RotaryEmbedding,
    DeepseekV4TopKRouter,
)

MTP_LAYER_TYPE = "sliding_attention"
MTP_MLP_TYPE = "moe"
PREFIX = "mtp.0."
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Our module name -> the checkpoint's name (after PREFIX). The routed experts are mapped by
# `_expert_names` (one [E, 2I, D] / [E, D, I] pair here, three matrices per expert there).
_NAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
    "layer.input_layernorm.weight": "attn_norm.weight",
    "layer.post_attention_layernorm.weight": "ffn_norm.weight",
    "layer.attn_hc.fn": "hc_attn_fn",
    "layer.attn_hc.base": "hc_attn_base",
    "layer.attn_hc.scale": "hc_attn_scale",
    "layer.ffn_hc.fn": "hc_ffn_fn",
    "layer.ffn_hc.base": "hc_ffn_base",
    "layer.ffn_hc.scale": "hc_ffn_scale",
    "layer.self_attn.sinks": "attn.attn_sink",
    "layer.self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "layer.self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "layer.self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "layer.self_attn.kv_proj.weight": "attn.wkv.weight",
    "layer.self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "layer.self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "layer.self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "layer.mlp.gate.weight": "ffn.gate.weight",
    "layer.mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "layer.mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "layer.mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "layer.mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
}
_GATE_UP, _DOWN = "layer.mlp.experts.gate_up_proj", "layer.mlp.experts.down_proj"

# transformers' `_keep_in_fp32_modules_strict` for DeepSeek-V4, plus this block's own norms.
_FP32_PARTS = frozenset({"attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias",
                         "e_score_correction_bias", "q_a_norm", "kv_norm", "input_layernorm",
                         "post_attention_layernorm", "norm", "enorm", "hnorm"})


def mtp_config(config: Any) -> Any:
    """A copy of the trunk's `DeepseekV4Config` with one more layer, the MTP layer: index
    `config.num_hidden_layers`, type `MTP_LAYER_TYPE`, MoE `MTP_MLP_TYPE`. The trunk's
    config is not changed."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = config.num_hidden_layers + 1
    cfg.layer_types = [*config.layer_types, MTP_LAYER_TYPE]
    cfg.mlp_layer_types = [*config.mlp_layer_types, MTP_MLP_TYPE]
    if cfg._attn_implementation is None:
        cfg._attn_implementation = "eager"  # DeepSeek-V4 ships eager-only
    return cfg


class MTPBlock(nn.Module):
    """The MTP block of a DeepSeek-V4 model with config `config` (the trunk's config).

    Holds no embedding and no lm_head: both are the trunk's and are passed in. Parameters
    are initialised like transformers' `_init_weights` (float32); see `random_mtp` for a
    test block whose sinks and routing bias are not zero.

    Shapes: B batch, S tokens, hc = config.hc_mult, D = config.hidden_size, V vocab.
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = mtp_config(config)
        self.layer_idx = config.num_hidden_layers
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.hnorm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.layer = DeepseekV4DecoderLayer(self.config, self.layer_idx)
        self.hc_head = DeepseekV4HyperHead(self.config)
        self.norm = DeepseekV4RMSNorm(hidden, eps=eps)
        self.rotary_emb = DeepseekV4RotaryEmbedding(self.config)  # no weights
        self.float()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """transformers' DeepSeek-V4 init: normal(0, initializer_range) for projections,
        experts, routers and mHC `fn`; zeros for biases, sinks and mHC `base`; ones for mHC
        `scale` and norm weights. Mutates the parameters in place."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, DeepseekV4RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, DeepseekV4TopKRouter):
                module.weight.normal_(0.0, std)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, DeepseekV4Experts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, DeepseekV4Attention):
                module.sinks.zero_()
            elif isinstance(module, DeepseekV4HyperConnection):
                module.fn.normal_(0.0, std)
                module.base.zero_()
                module.scale.fill_(1.0)
            elif isinstance(module, DeepseekV4HyperHead):
                module.hc_fn.normal_(0.0, std)
                module.hc_base.zero_()
                module.hc_scale.fill_(1.0)

    def combine(self, trunk_hidden: torch.Tensor, input_ids: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer's input [B, S, hc, D] from the trunk's pre-`hc_head` hidden
        `trunk_hidden` [B, S, hc, D] at positions i and the next tokens `input_ids` [B, S]
        (t_{i+1}), embedded with the trunk's `embed` (`model.model.embed_tokens`):
        `e_proj(enorm(embed(ids)))[:, :, None] + h_proj(hnorm(trunk_hidden))`."""
        e = self.e_proj(self.enorm(embed(input_ids)))
        return e.unsqueeze(2) + self.h_proj(self.hnorm(trunk_hidden))

    def layer_forward(self, hidden: torch.Tensor,
                      attention: Callable[[torch.Tensor], torch.Tensor],
                      input_ids: torch.Tensor | None) -> torch.Tensor:
        """`self.layer`'s forward with its attention replaced by `attention`, which maps the
        normed collapsed stream [B, S, D] to the attention output [B, S, D]. `hidden`
        [B, S, hc, D] -> [B, S, hc, D]. Same sub-calls and casts as
        `DeepseekV4DecoderLayer.forward` (module docstring)."""
        layer = self.layer
        dtype = hidden.dtype
        post, comb, collapsed = layer.attn_hc(hidden)
        out = attention(layer.input_layernorm(collapsed))
        hidden = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)
        post, comb, collapsed = layer.ffn_hc(hidden)
        mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=input_ids)
        return post.to(dtype).unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), hidden)

    def head(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
        """Logits [B, S, V] = lm_head(norm(hc_head(hidden))) for the layer's output
        `hidden` [B, S, hc, D]; `lm_head` is the trunk's (`model.lm_head`)."""
        return lm_head(self.norm(self.hc_head(hidden)))

    def reference_forward(self, trunk_hidden: torch.Tensor, next_ids: torch.Tensor,
                          embed: Callable[[torch.Tensor], torch.Tensor],
                          lm_head: Callable[[torch.Tensor], torch.Tensor],
                          position_ids: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uncached forward over a whole sequence, through transformers' own
        `DeepseekV4DecoderLayer.forward` with the sliding-window causal mask and the RoPE
        tables `DeepseekV4Model.forward` builds.

        `trunk_hidden` [B, S, hc, D] (positions 0..S-1, see `trunk_hidden`), `next_ids`
        [B, S] (the token after each position), `position_ids` [B, S] (default 0..S-1).
        Returns (logits [B, S, V] predicting the token two after each position, the layer's
        output [B, S, hc, D], which a second draft step would feed back as trunk_hidden).
        Differentiable; wrap in `torch.no_grad()` for inference."""
        hidden = self.combine(trunk_hidden, next_ids, embed)
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
        shaped = hidden[:, :, 0]  # batch, length and dtype, as the model's inputs_embeds
        mask = create_sliding_window_causal_mask(config=self.config, inputs_embeds=shaped,
                                                 attention_mask=None, cache=None,
                                                 position_ids=position_ids)
        rope = {kind: self.rotary_emb(shaped, position_ids=position_ids, layer_type=kind)
                for kind in ("main", "compress")}
        out = self.layer(hidden, position_embeddings=rope, position_ids=position_ids,
                         attention_mask=mask, input_ids=next_ids, cache=None)
        return self.head(out, lm_head), out


def trunk_forward(model: Any, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached forward of a `DeepseekV4ForCausalLM`: (logits [B, S, V], the hidden the
    MTP consumes [B, S, hc, D]: the last decoder layer's output, the input of
    `model.model.hc_head`). Keeps the autograd graph when grad is enabled."""
    seen: list[torch.Tensor] = []
    handle = model.model.hc_head.register_forward_pre_hook(
        lambda _module, args: seen.append(args[0]))
    try:
        logits = model(input_ids=input_ids).logits
    finally:
        handle.remove()
    if len(seen) != 1:
        raise RuntimeError(f"expected one hc_head call in the trunk, saw {len(seen)}")
    return logits, seen[0]


def trunk_hidden(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The trunk's pre-`hc_head` hidden [B, S, hc, D] for `input_ids` [B, S] (see
    `trunk_forward`)."""
    return trunk_forward(model, input_ids)[1]


def mtp_state_dict(block: MTPBlock) -> dict[str, torch.Tensor]:
    """The block's tensors under the checkpoint's names (`mtp.0.` + DeepSeek's names),
    detached and contiguous (sharing storage with the block where they already were), ready
    for `safetensors.torch.save_file`. Changes nothing."""
    own = block.state_dict()
    assert set(own) == set(_NAMES) | {_GATE_UP, _DOWN}, sorted(set(own) ^ set(_NAMES))
    out = {PREFIX + theirs: own[ours].detach().contiguous() for ours, theirs in _NAMES.items()}
    gate_up, down = own[_GATE_UP].detach(), own[_DOWN].detach()
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        w1, w2, w3 = _expert_names(e)
        out[w1] = gate_up[e, :inter].contiguous()
        out[w3] = gate_up[e, inter:].contiguous()
        out[w2] = down[e].contiguous()
    return out


def _expert_names(e: int) -> tuple[str, str, str]:
    """The checkpoint's (gate w1, down w2, up w3) names of routed expert `e`."""
    base = f"{PREFIX}ffn.experts.{e}."
    return base + "w1.weight", base + "w2.weight", base + "w3.weight"


def _load_tensors(block: MTPBlock, tensors: dict[str, torch.Tensor]) -> None:
    """Copies checkpoint-named `tensors` into `block`; ValueError on missing, extra or
    mis-shaped keys, on tensors not of a floating dtype or of an FP8/FP4 one (their scales
    are not handled) and on tensors that are not all finite (nothing is copied then)."""
    expected = {k: v.shape for k, v in mtp_state_dict(block).items()}
    quantized = sorted(k for k in tensors if k.endswith(".scale"))
    if quantized:
        raise ValueError(f"quantized MTP tensors are not supported (FP8/FP4 with scales: "
                         f"{quantized[:3]}...); dequantize the checkpoint's mtp.0.* first")
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"MTP tensors do not match the config: missing {missing[:8]}"
                         f"{'...' if len(missing) > 8 else ''}, unexpected {extra[:8]}"
                         f"{'...' if len(extra) > 8 else ''}")
    bad = [f"{k}: {tuple(tensors[k].shape)} != {tuple(s)}" for k, s in expected.items()
           if tensors[k].shape != s]
    if bad:
        raise ValueError(f"MTP tensors have the wrong shape for the config: {bad[:8]}")
    dtypes = sorted(f"{k}: {t.dtype}" for k, t in tensors.items()
                    if not t.is_floating_point() or _is_low_bit(t.dtype))
    if dtypes:
        raise ValueError(f"MTP tensors of an unsupported dtype (not floating point, or FP8/FP4 "
                         f"without scales): {dtypes[:8]}{'...' if len(dtypes) > 8 else ''}")
    nonfinite = sorted(k for k, t in tensors.items() if not bool(torch.isfinite(t).all()))
    if nonfinite:
        raise ValueError(f"MTP tensors with NaN or infinite values (not finite): "
                         f"{nonfinite[:8]}{'...' if len(nonfinite) > 8 else ''}")
    own = block.state_dict()
    with torch.no_grad():
        for ours, theirs in _NAMES.items():
            own[ours].copy_(tensors[PREFIX + theirs])
        inter = own[_GATE_UP].shape[1] // 2
        for e in range(own[_GATE_UP].shape[0]):
            w1, w2, w3 = _expert_names(e)
            own[_GATE_UP][e, :inter].copy_(tensors[w1])
            own[_GATE_UP][e, inter:].copy_(tensors[w3])
            own[_DOWN][e].copy_(tensors[w2])


def _is_low_bit(dtype: torch.dtype) -> bool:
    """FP8 / FP4 (float8_*, float4_*): stored with scales this block does not apply."""
    return str(dtype).removeprefix("torch.").startswith(("float8", "float4"))


def cast_block(block: MTPBlock, dtype: torch.dtype) -> MTPBlock:
    """Casts the block's parameters to `dtype` in place, except those transformers keeps in
    float32 in a DeepSeek-V4 model (norms, mHC, hc_head, sinks, routing bias). Returns it."""
    for name, param in block.named_parameters():
        param.data = param.data.to(part_dtype(name, dtype))
    return block


def part_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the block's parameter `name` in a model of `dtype` (`cast_block`)."""
    return torch.float32 if _FP32_PARTS.intersection(name.split(".")) else dtype


def load_mtp(model_dir: str | Path, config: Any, dtype: torch.dtype = torch.float32
             ) -> MTPBlock | None:
    """The MTP block stored under `mtp.0.` in `model_dir`'s checkpoint, in `dtype` (with
    transformers' float32 exceptions), in eval mode; None when the checkpoint has none.

    Reads only the files the checkpoint names (`_mtp_files`): those of
    `model.safetensors.index.json`'s weight_map that hold `mtp.0.*` keys, else
    `model.safetensors`. Raises ValueError when the tensors are missing, extra, found twice,
    mis-shaped, quantized, not floating point or not finite, when a file is unreadable or
    truncated (naming it), or when the checkpoint's raw `config.json` makes the MTP layer
    anything but a sliding-window MoE layer (`compress_ratios`, `layer_types`,
    `mlp_layer_types` at index num_hidden_layers).
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    _check_mtp_layer(model_dir, config)
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for path in _mtp_files(model_dir):
        with _reading(path), safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if not key.startswith(PREFIX):
                    continue
                if key in tensors:
                    raise ValueError(f"MTP tensor {key} is in both {where[key].name} and "
                                     f"{path.name}")
                tensors[key], where[key] = f.get_tensor(key), path
    if not tensors:
        return None
    block = MTPBlock(config)
    _load_tensors(block, tensors)
    return cast_block(block, dtype).eval()


def has_mtp(model_dir: str | Path) -> bool:
    """Whether the checkpoint in `model_dir` names any `mtp.0.*` tensor, cheaply (no tensor
    is read): the keys of `model.safetensors.index.json`'s weight_map, else the header of
    `model.safetensors`. False without either. ValueError for an unreadable index or
    header (naming the file)."""
    model_dir = Path(model_dir)
    index = _index(model_dir)
    if index is not None:
        return any(k.startswith(PREFIX) for k in index)
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        return False
    from safetensors import safe_open

    with _reading(single), safe_open(str(single), framework="pt") as f:
        return any(k.startswith(PREFIX) for k in f.keys())  # noqa: SIM118


def _index(model_dir: Path) -> dict[str, str] | None:
    """The weight_map of `model_dir`'s safetensors index (None: no index)."""
    path = model_dir / INDEX_FILE
    if not path.exists():
        return None
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable safetensors index "
                         f"({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{path}: weight_map is not a mapping of tensor names to files")
    return weight_map


def _mtp_files(model_dir: Path) -> list[Path]:
    """The files holding the MTP tensors, as the checkpoint names them: the index's files
    for `mtp.0.*` keys, else `model.safetensors` (none when it has neither)."""
    index = _index(model_dir)
    if index is not None:
        names = sorted({v for k, v in index.items() if k.startswith(PREFIX)})
        return [model_dir / name for name in names]
    single = model_dir / SINGLE_FILE
    return [single] if single.exists() else []


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Safetensors' and the OS's errors reading `path` (a truncated, corrupt or missing
    file) become a one-line ValueError naming the file."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError) as error:
        detail = " ".join(str(error).split())
        raise ValueError(f"{path}: unreadable safetensors file "
                         f"({type(error).__name__}: {detail})") from None


def _check_mtp_layer(model_dir: Path, config: Any) -> None:
    """ValueError when the raw config.json (transformers cuts `layer_types` and
    `mlp_layer_types` to num_hidden_layers, so the loaded config cannot tell) gives the MTP
    layer (index num_hidden_layers) a compress ratio other than 0, a layer type other than
    `MTP_LAYER_TYPE` or an MLP type other than `MTP_MLP_TYPE`."""
    path = model_dir / "config.json"
    if not path.exists():
        return
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        return
    n = config.num_hidden_layers
    ratios = raw.get("compress_ratios")
    if isinstance(ratios, list) and len(ratios) > n and ratios[n] != 0:
        raise ValueError(f"the checkpoint's MTP layer has compress ratio {ratios[n]}; only "
                         "sliding-window MTP layers (ratio 0) are supported")
    kinds = raw.get("layer_types")
    if isinstance(kinds, list) and len(kinds) > n and kinds[n] != MTP_LAYER_TYPE:
        raise ValueError(f"the checkpoint's MTP layer is {kinds[n]!r} (layer_types[{n}]); "
                         f"only {MTP_LAYER_TYPE!r} MTP layers (compress ratio 0) are "
                         "supported")
    mlps = raw.get("mlp_layer_types")
    if isinstance(mlps, list) and len(mlps) > n and mlps[n] != MTP_MLP_TYPE:
        raise ValueError(f"the checkpoint's MTP layer's MLP is {mlps[n]!r} "
                         f"(mlp_layer_types[{n}]); only {MTP_MLP_TYPE!r} is supported")


def save_mtp(model_dir: str | Path, block: MTPBlock) -> None:
    """Adds the block's `mtp.0.*` tensors to a `save_pretrained` checkpoint directory:
    into `model.safetensors` when it is a single file, else as `model-mtp.safetensors`
    listed in `model.safetensors.index.json`. Replaces earlier `mtp.0.*` tensors.
    transformers' `from_pretrained` ignores them (`_keys_to_ignore_on_load_unexpected`)."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    tensors = mtp_state_dict(block)
    index_path = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        weight_map = {k: v for k, v in index["weight_map"].items() if not k.startswith(PREFIX)}
        save_file(tensors, str(model_dir / "model-mtp.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index["weight_map"] = weight_map
        index_path.write_text(json.dumps(index, indent=2))
    elif single.exists():
        merged = {k: v for k, v in load_file(str(single)).items() if not k.startswith(PREFIX)}
        merged.update(tensors)
        save_file(merged, str(single), metadata={"format": "pt"})
    else:
        raise ValueError(f"{model_dir} has no model.safetensors or index; save_pretrained first")


def random_mtp(config: Any, seed: int = 0) -> MTPBlock:
    """A float32 eval-mode MTP block for tests: transformers' init, then the sinks and the
    routing score-correction bias randomised (zeros would hide addressing and routing bugs,
    as `tiny_deepseek_v4` does for the trunk). Deterministic in `seed`."""
    torch.manual_seed(seed)
    block = MTPBlock(config)
    own = block.state_dict()  # shares storage with the parameters and buffers
    with torch.no_grad():
        own["layer.self_attn.sinks"].normal_()
        own["layer.mlp.gate.e_score_correction_bias"].normal_(0.0, 0.1)
    return block.eval()
