"""Train a tiny DeepSeek-V4 and its MTP block on CPU, so speculative-decoding figures are honest.

    python benchmarks/train_tiny.py --out out/tiny_mtp            # 500 steps, 3-7 minutes
    python benchmarks/train_tiny.py --out /tmp/t --quick          # 20 steps, for tests

The model: byte-level (vocab 256, EOS 0), hidden 96, 4 layers [SWA, CSA, HCA, CSA],
compress rates {CSA: 4, HCA: 16}, sliding window 16, half of each head rotary (a copy
needs the position; the real model's 64 of 512 dims are too few at head_dim 32). The data
(`copy_edit.py`): one sequence in four is English text from the standard library's
docstrings, the others packed copy/edit examples (a span, then the span again with a few
edits). The loss is DeepSeek's: next-token cross-entropy for the trunk plus `--mtp-weight`
times the MTP's cross-entropy on the token two ahead (trunk hidden at t and the embedding
of t+1 predict t+2), both through transformers' uncached training forward.

`--out DIR` writes `config.json` and `model.safetensors` with `save_pretrained`, the MTP's
`mtp.0.*` tensors added to the same file (`shadowradix.model.mtp.save_mtp`) and the byte
tokenizer (`byte_tokenizer`, so `shadowradix serve --model DIR` starts), and checks that
`DeepseekV4ForCausalLM.from_pretrained(DIR)`, `load_mtp(DIR, config)` and the tokenizer
load it.
At the end it prints teacher-forced greedy accuracy on held-out copy/edit answers (trunk:
next token; MTP: the token two ahead, from the true next token) and on held-out text.
Reproducible from `--seed` (the same losses at 1 and 2 threads here). One thread is the
default: on a busy shared 2-core machine two threads ran 8x slower (oversubscription).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from copy_edit import EOS, CopyEditPrompt, copy_edit_prompts, example, text_chunk
from transformers import DeepseekV4ForCausalLM

from shadowradix.model.mtp import MTPBlock, load_mtp, random_mtp, save_mtp, trunk_forward
from shadowradix.model.tiny import CSA, HCA, SWA, tiny_deepseek_v4

SETTINGS: dict[str, Any] = dict(
    vocab_size=256, hidden_size=96, num_attention_heads=4, head_dim=32, q_lora_rank=48,
    o_groups=2, o_lora_rank=32, index_n_heads=16, index_head_dim=16, index_topk=4,
    sliding_window=16, compress_rates={CSA: 4, HCA: 16}, layer_types=[SWA, CSA, HCA, CSA],
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, hc_mult=2,
    partial_rotary_factor=0.5, bos_token_id=EOS, eos_token_id=EOS)


def build(seed: int) -> tuple[Any, MTPBlock]:
    """A fresh trunk (tiny.py's init, in train mode) and MTP block."""
    model = tiny_deepseek_v4(seed, **SETTINGS).train()
    return model, random_mtp(model.config, seed + 1).train()


def batch(rng: random.Random, part: str, size: int, length: int) -> torch.Tensor:
    """[size, length] token ids: one row in four English text, the others packed copy/edit
    examples (each with a 0-16 byte preamble of text)."""
    rows = []
    for i in range(size):
        if i % 4 == 0:
            row = list(text_chunk(rng, part, length))
        else:
            row = []
            while len(row) < length:
                ex = example(rng, part, (0, 16))
                row += ex.prompt + ex.answer
        rows.append(row[:length])
    return torch.tensor(rows, dtype=torch.long)


def losses(model: Any, mtp: MTPBlock, ids: torch.Tensor,
           chain: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(trunk next-token loss, MTP loss on the token two ahead) for ids [B, T]. With
    `chain` > 1 the MTP loss is the mean over `chain` passes, pass s feeding the block its
    own output hidden of pass s - 1 one position on (as chained drafting does: draft s
    comes from the block's hidden at draft s - 1, not the trunk's)."""
    logits, hidden = trunk_forward(model, ids)
    trunk = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    embed, head = model.model.embed_tokens, model.lm_head
    mtp_logits, out = mtp.reference_forward(hidden[:, :-1], ids[:, 1:], embed, head)
    mtp_loss = F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1), ids[:, 2:].flatten())
    for s in range(2, chain + 1):  # positions s-1 .. : hidden from the last pass, one back
        n = out.shape[1] - 1
        if n < 2:
            break
        pos = torch.arange(s - 1, s - 1 + n, device=ids.device)[None].expand(ids.shape[0], -1)
        mtp_logits, out = mtp.reference_forward(out[:, :-1], ids[:, s:s + n], embed, head,
                                                position_ids=pos)
        mtp_loss = mtp_loss + F.cross_entropy(mtp_logits[:, :-1].flatten(0, 1),
                                              ids[:, s + 1:s + n].flatten())
    return trunk, mtp_loss / chain


@torch.no_grad()
def predictions(model: Any, mtp: MTPBlock, ids: list[int]) -> tuple[list[int], list[int]]:
    """Greedy (trunk: x[i+1] at i, MTP: x[i+2] at i from the true x[i+1]) for one sequence."""
    x = torch.tensor([ids])
    logits, hidden = trunk_forward(model, x)
    mtp_logits, _ = mtp.reference_forward(hidden, torch.cat([x[:, 1:], x[:, -1:]], 1),
                                          model.model.embed_tokens, model.lm_head)
    return logits[0].argmax(-1).tolist(), mtp_logits[0].argmax(-1).tolist()


def evaluate(model: Any, mtp: MTPBlock, prompts: list[CopyEditPrompt], texts: list[bytes]
             ) -> dict[str, float]:
    """Teacher-forced greedy accuracy: on the answers (trunk over every answer token; MTP
    over answer tokens from the second on, i.e. the drafts made after the prompt) and on
    held-out text."""
    was = model.training, mtp.training
    model.eval(), mtp.eval()
    hits = {"answer_trunk": [0, 0], "answer_mtp": [0, 0], "text_trunk": [0, 0],
            "text_mtp": [0, 0]}
    for p in prompts:
        ids = p.prompt + p.answer
        trunk, drafts = predictions(model, mtp, ids)
        start = len(p.prompt)
        for j in range(start, len(ids)):
            _count(hits["answer_trunk"], trunk[j - 1] == ids[j])
            if j > start:
                _count(hits["answer_mtp"], drafts[j - 2] == ids[j])
    for t in texts:
        ids = list(t)
        trunk, drafts = predictions(model, mtp, ids)
        for j in range(2, len(ids)):
            _count(hits["text_trunk"], trunk[j - 1] == ids[j])
            _count(hits["text_mtp"], drafts[j - 2] == ids[j])
    model.train(was[0]), mtp.train(was[1])
    return {k: h / max(n, 1) for k, (h, n) in hits.items()}


def _count(cell: list[int], hit: bool) -> None:
    cell[0] += int(hit)
    cell[1] += 1


def byte_tokenizer() -> Any:
    """The tokenizer of this model's tokens, which are bytes (id = byte value, EOS 0): a
    byte-level BPE without merges whose vocabulary maps each byte's ByteLevel character
    (GPT-2's byte-to-unicode table) to the byte. A `PreTrainedTokenizerFast`; its
    `save_pretrained(DIR)` makes DIR loadable by `AutoTokenizer` (`serve --model DIR`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[EOS],
                                   clean_up_tokenization_spaces=False)


def check_byte_tokenizer(tokenizer: Any, text: bytes) -> None:
    """RuntimeError unless `tokenizer` maps the ASCII `text`'s bytes to their values and
    back (encode without special tokens, decode skipping them)."""
    ids = tokenizer.encode(text.decode("ascii"), add_special_tokens=False)
    back = tokenizer.decode(list(text), skip_special_tokens=True)
    if ids != list(text) or back != text.decode("ascii"):
        raise RuntimeError(f"the byte tokenizer does not round-trip {text[:40]!r}: "
                           f"ids {ids[:12]}, decoded {back[:40]!r}")


def save(model: Any, mtp: MTPBlock, out: Path) -> None:
    """save_pretrained plus the MTP tensors and the byte tokenizer (`byte_tokenizer`), so
    `serve --model DIR` loads it; checks that all three load back."""
    from transformers import AutoTokenizer

    model.save_pretrained(str(out))
    save_mtp(out, mtp)
    byte_tokenizer().save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    check_byte_tokenizer(tokenizer, bytes(range(1, 128)))  # every ASCII byte but EOS
    for p in copy_edit_prompts(8, 0):  # the copy/edit text, its ASCII bytes
        check_byte_tokenizer(tokenizer, bytes(b for b in p.prompt + p.answer if 0 < b < 128))
    loaded, info = DeepseekV4ForCausalLM.from_pretrained(str(out), output_loading_info=True)
    if any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
        raise RuntimeError(f"the saved checkpoint does not load cleanly: {info}")
    block = load_mtp(out, loaded.config)
    if block is None:
        raise RuntimeError("the saved checkpoint has no MTP block")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=96)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--mtp-chain", type=int, default=3,
                    help="MTP passes per batch, each fed the block's own hidden (1: DeepSeek's "
                         "single-step loss; more: trained for chained drafts)")
    ap.add_argument("--quick", action="store_true", help="20 steps, small eval (for tests)")
    args = ap.parse_args(argv)
    steps = 20 if args.quick else args.steps
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    model, mtp = build(args.seed)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / steps))))
    t0 = time.perf_counter()
    every = 5 if args.quick else 25
    for step in range(1, steps + 1):
        trunk, mtp_loss = losses(model, mtp, batch(rng, "train", args.batch, args.length),
                                 args.mtp_chain)
        loss = trunk + args.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % every == 0 or step == steps:
            print(f"step {step:5d}  loss {loss.item():.3f}  trunk {trunk.item():.3f}  "
                  f"mtp {mtp_loss.item():.3f}  {time.perf_counter() - t0:6.1f}s", flush=True)
    n_eval = 8 if args.quick else 64
    erng = random.Random(args.seed + 1000)
    acc = evaluate(model, mtp, copy_edit_prompts(n_eval, args.seed + 1000),
                   [text_chunk(erng, "test", args.length) for _ in range(n_eval // 2)])
    print("held-out greedy accuracy: " + "  ".join(f"{k} {v:.3f}" for k, v in acc.items()))
    print(f"trained {steps} steps in {time.perf_counter() - t0:.1f}s")
    if args.out is not None:
        save(model.eval(), mtp.eval(), args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
