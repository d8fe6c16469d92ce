"""The pooled DeepSeek-V4 forward against transformers' uncached forward (float32, CPU)."""

import pytest
import torch
from conftest import LOGIT_DIFFS
from tiny_model import CSA, HCA, SWA, Driver, reference_logits, tiny_model

TOL = 1e-4


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def close(a, b) -> float:
    diff = (a - b).abs().max().item()
    LOGIT_DIFFS.append(diff)
    assert diff <= TOL, diff
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    return diff


@pytest.mark.parametrize("chunks", [None, [37, 27, 35], [1] * 20 + [80], [5, 3, 16, 29]])
def test_cold_prefill_in_odd_chunks_matches_transformers(model, chunks):
    tokens = rand_tokens(100, 1)
    out, cached = Driver(model).run(tokens, chunks)
    assert cached == 0
    close(out, reference_logits(model, tokens))


def test_token_by_token_decode_matches_transformers(model):
    tokens = rand_tokens(70, 2)
    out, _ = Driver(model).run(tokens, [40] + [1] * 30)
    close(out, reference_logits(model, tokens))


def test_second_turn_resumes_from_the_tree_exactly(model):
    drv = Driver(model)
    first = rand_tokens(75, 3)
    drv.run(first)
    second = first + rand_tokens(40, 4)
    out, cached = drv.run(second, [9, 13, 100])
    assert cached == 64  # the last page boundary of the first turn
    close(out, reference_logits(model, second)[cached:])
    drv.cache.check_integrity(held={})


def test_shared_system_prompt_third_request_hits_at_the_branch(model):
    drv = Driver(model)
    system = rand_tokens(48, 5)
    for i, want in enumerate((0, 48, 48)):
        tokens = system + rand_tokens(30, 10 + i)
        out, cached = drv.run(tokens)
        assert cached == want
        close(out, reference_logits(model, tokens)[cached:])


def test_eviction_between_turns_keeps_outputs_exact(model):
    drv = Driver(model, pages=8)  # room for about one conversation at a time
    a = rand_tokens(90, 6)
    drv.run(a)
    drv.run(rand_tokens(90, 7))  # pushes most of `a` out
    tokens = a + rand_tokens(20, 8)
    out, cached = drv.run(tokens)
    assert sum(drv.cache.evicted.values()) > 0
    close(out, reference_logits(model, tokens)[cached:])


def test_decode_reads_only_top_k_c4_entries_at_any_context(model, monkeypatch):
    """A real sparse gather: per decode step and CSA layer, C4 is addressed for at most
    top-k reads plus one write, however long the context (a dense read would grow)."""
    from shadowradix.model.context import PagedStorage

    seen: list[int] = []
    original = PagedStorage.address

    def counting(self, pool, table, positions):
        if pool == "c4":
            seen.append(positions.numel())
        return original(self, pool, table, positions)

    drv = Driver(model, pages=64)
    tokens = rand_tokens(300, 9)
    monkeypatch.setattr(PagedStorage, "address", counting)
    drv.run(tokens[:280])  # 70 C4 entries per CSA layer
    assert max(seen) >= 70
    seen.clear()
    out, cached = drv.run(tokens, [1] * 40)  # resume at 272, then one token per step
    assert cached == 272 and seen
    assert max(seen) <= model.config.index_topk
    close(out, reference_logits(model, tokens)[cached:])


@pytest.mark.parametrize("layer_types, window, page_size", [
    ([CSA, HCA, CSA], 8, 16),      # no pure sliding-window layer
    ([SWA, CSA, HCA], 24, 16),     # window larger than a page
    ([HCA, CSA, SWA, CSA], 8, 32),
    ([SWA, SWA], 8, 16),           # no compressed layer: no state pool
    ([HCA, HCA], 8, 16),
    ([HCA, SWA], 24, 32),
])
def test_layer_mixes_windows_and_page_sizes(layer_types, window, page_size):
    mdl = tiny_model(layer_types, window=window, seed=3)
    drv = Driver(mdl, page_size=page_size, pages=48)
    first = rand_tokens(70, 11)
    drv.run(first, [13, 29])
    second = first + rand_tokens(30, 12)
    out, cached = drv.run(second, [7, 100])
    assert cached == (70 // page_size) * page_size
    close(out, reference_logits(mdl, second)[cached:])
