"""Tokenizers for the server: a checkpoint's own (AutoTokenizer), or the tiny model's.

The tiny model's is a byte-level BPE trained at start-up with the `tokenizers` library on
a small built-in text, padded to the model's vocabulary so every id it can emit decodes.
Its special tokens and chat template follow DeepSeek's, with ids matching the model
config (bos 0, eos 1). Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

BOS, EOS, USER, ASSISTANT = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>",
                             "<｜Assistant｜>")

# DeepSeek's shape: the system prompt first, then alternating turns; an answer ends in EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}")

# Enough varied text (English, code, numbers, Chinese) for the BPE to learn real merges.
_CORPUS = """\
The cache keeps every form of a token: sliding-window keys, compressed keys, indexer keys,
and the compressor state. A prefix that two requests share is computed once and read twice.
Hello, world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. The quick brown fox jumps over the lazy dog 1234567890.
def forward(self, input_ids, positions): return self.model(input_ids, positions=positions)
for i in range(10): print(i, i * i, "squares") # comments explain why, not what
{"role": "user", "content": "Summarise the article in three sentences."}
你好，世界！今天天气很好。我们在讨论大语言模型的键值缓存。前缀缓存可以复用计算结果。
稀疏注意力只读取一部分压缩后的键值，热工作集留在显存里，完整历史留在主机内存中。
Emoji and symbols: ✓ ✗ → ← ★ 😀 🚀 ∑ ∫ π ≈ ≠ ≤ ≥ € £ ¥ © ®.
"""


def tiny_tokenizer(vocab_size: int) -> Any:
    """A `PreTrainedTokenizerFast` of exactly `vocab_size` ids (bos 0, eos 1), with a chat
    template. Deterministic: the same text and settings train the same merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [BOS, EOS, USER, ASSISTANT]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    short = vocab_size - tok.get_vocab_size()
    if short > 0:  # the text ran out of merges: reserved ids, so every id decodes
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"tiny tokenizer has {tok.get_vocab_size()} ids, want {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   chat_template=CHAT_TEMPLATE)


def load_tokenizer(path: str) -> Any:
    """A checkpoint directory's tokenizer and chat template (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
