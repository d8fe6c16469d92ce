"""Drafters for the speculative-decoding tests: proposers that know the true greedy
continuation of each prompt (so they can be right, wrong, or right for a while), a driver
that steps an engine online with `check_integrity` after every step, and a walk over what
the tree holds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from shadowradix import CacheConfig, Engine, SamplingParams, SpecConfig
from shadowradix.tree.tier import DEVICE, HOST

VOCAB = 256


def rand_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@dataclass
class Truth:
    """Known continuations: full token sequences (prompt + the target's greedy outputs).
    `Truth.of(tokens)` is the sequence `tokens` is a prefix of (the longest, when several
    are), or None."""

    sequences: list[list[int]] = field(default_factory=list)

    def add(self, prompt: Sequence[int], outputs: Sequence[int]) -> None:
        self.sequences.append([*prompt, *outputs])

    def of(self, tokens: Sequence[int]) -> tuple[int, list[int]] | None:
        n = len(tokens)
        best = None
        for i, seq in enumerate(self.sequences):
            if len(seq) > n and seq[:n] == list(tokens) and (
                    best is None or len(seq) > len(best[1])):
                best = (i, seq)
        return best


class Proposer:
    """A custom proposer from a Truth. kind: "oracle" (the true continuation: every draft
    is accepted), "wrong" ((true + 1) % vocab at every position: the first draft token is
    always rejected), "half" (right for the first `right` tokens, then wrong), "none"
    (never drafts). Unknown sequences get no draft. Records every call: (sequence index or
    None, len(tokens), k)."""

    def __init__(self, truth: Truth, kind: str, right: int = 0, vocab: int = VOCAB) -> None:
        assert kind in ("oracle", "wrong", "half", "none")
        self.truth, self.kind, self.right, self.vocab = truth, kind, right, vocab
        self.calls: list[tuple[int | None, int, int]] = []

    def __call__(self, tokens: Sequence[int], k: int) -> list[int]:
        found = self.truth.of(tokens)
        self.calls.append((None if found is None else found[0], len(tokens), k))
        if found is None or self.kind == "none":
            return []
        n = len(tokens)
        true = found[1][n:n + k]
        right = {"oracle": k, "wrong": 0, "half": self.right}[self.kind]
        return [t if i < right else (t + 1) % self.vocab for i, t in enumerate(true)]


def spec(proposer: object | None = None, k: int = 3, method: str | None = None,
         **kw: object) -> SpecConfig:
    if method is None:
        method = "ngram" if proposer is None else "custom"
    return SpecConfig(method=method, num_draft_tokens=k, proposer=proposer, **kw)  # type: ignore[arg-type]


def make(model, speculative: SpecConfig | None = None, step_tokens: int = 512,
         **cfg: object) -> Engine:
    config = {"page_size": 16, "device_tokens": 2048, "debug_poison": True, **cfg}
    return Engine.from_hf(model, CacheConfig(**config), step_tokens=step_tokens,  # type: ignore[arg-type]
                          speculative=speculative)


@dataclass
class Run:
    """What an online run produced, per request id."""

    results: dict = field(default_factory=dict)
    streams: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    finished: dict = field(default_factory=dict)  # id -> times reported finished
    steps: int = 0


def drain(eng: Engine, run: Run | None = None, limit: int = 5000) -> Run:
    """Step until nothing is left, `check_integrity` after every step."""
    run = run or Run()
    while eng.has_unfinished():
        collect(eng, run, eng.step())
        assert run.steps < limit, "the engine does not finish"
    return run


def collect(eng: Engine, run: Run, outputs) -> None:  # type: ignore[no-untyped-def]
    run.steps += 1
    for out in outputs:
        assert not run.finished.get(out.request_id), f"{out.request_id} reported after finish"
        run.streams.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.finished:
            run.finished[out.request_id] = run.finished.get(out.request_id, 0) + 1
            if out.error is not None:
                run.errors[out.request_id] = out.error
            else:
                run.results[out.request_id] = out.result
                assert out.result.output_ids == run.streams[out.request_id]
    eng.check_integrity()


def online(eng: Engine, prompts: Sequence[Sequence[int]],
           params: SamplingParams | Sequence[SamplingParams],
           return_logits: bool = True) -> tuple[list[str], Run]:
    """Add every prompt, then drain; the request ids in prompt order and the run."""
    ps = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    ids = [eng.add_request(list(p), q, return_logits=return_logits)
           for p, q in zip(prompts, ps, strict=True)]
    return ids, drain(eng)


def tree_contents(eng: Engine, tier: int = DEVICE,
                  rows: Sequence[str] | None = None) -> set[tuple[tuple[int, ...], str]]:
    """What the tree holds in one tier: (the tokens of the prefix ending at a logical page,
    pool name) for every page some pool holds there."""
    prefix = eng._prefix
    tree = prefix.tree
    names = list(eng.layout.pool_names)
    if tier == HOST and not prefix.has_host:
        return set()
    out = set()
    for node in tree.nodes():
        path = tree.path(node)
        tokens = [int(t) for n in path for t in n.tokens.tolist()]
        base = (node.start_page) * eng.config.page_size
        slot = node.slot(tier)
        for row, name in enumerate(names):
            if rows is not None and name not in rows:
                continue
            for i in range(node.n_pages):
                if slot[row, i] >= 0:
                    end = base + (i + 1) * eng.config.page_size
                    out.add((tuple(tokens[:end]), name))
    return out


def all_pool_names(eng: Engine) -> list[str]:
    """The pools a prefix keeps for every earlier position (Retention.ALL)."""
    from shadowradix.layout.spec import Retention

    return [p.name for p in eng.layout.pools if p.retention is Retention.ALL]
