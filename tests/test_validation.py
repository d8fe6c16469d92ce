"""Caller mistakes are refused at construction with a ValueError that says what to do,
instead of failing mid-generate or silently changing meaning."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_model import tiny_model

from shadowradix import CacheConfig, Engine, SamplingParams
from shadowradix.engine.validation import check_batch, model_layout


@pytest.mark.parametrize("kwargs, match", [
    (dict(page_size=True), "page_size"),
    (dict(page_size=16, device_tokens=True), "device_tokens"),
    (dict(page_size=1, device_tokens=True), "device_tokens"),
    (dict(page_size=1, host_tokens=True), "host_tokens"),
    (dict(write_hit_threshold=True), "write_hit_threshold"),
    (dict(page_size=16.0), "page_size"),
    (dict(page_size=16, device_tokens=100), "multiple of page_size"),
    (dict(page_size=16, host_tokens=100), "multiple of page_size"),
    (dict(page_size=16, host_tokens=-16), "host_tokens"),
])
def test_cache_config_refuses_bools_and_sizes_it_would_floor(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_cache_config_accepts_page_multiples():
    c = CacheConfig(page_size=16, device_tokens=160, host_tokens=32)
    assert (c.device_tokens, c.host_tokens) == (160, 32)
    assert CacheConfig(page_size=16, device_tokens=16, host_tokens=0).host_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=2 ** 70), "seed"),
    (dict(seed=2 ** 63), "seed"),
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=True), "seed"),
    (dict(greedy=False, temperature=-1e-39), "temperature must be a finite number >= 0"),
    (dict(temperature=-1.0), "temperature"),
    (dict(greedy=False, temperature=math.nan), "finite"),
    (dict(temperature=math.inf), "finite"),
    (dict(temperature=math.nan), "finite"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=math.inf), "top_p"),
    (dict(top_p=True), "top_p"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(greedy="yes"), "greedy"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_sampling_params_refuse_what_would_fail_later(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_accept_the_edges():
    assert SamplingParams(greedy=False, temperature=1e-5, seed=2 ** 63 - 1).seed == 2 ** 63 - 1
    assert SamplingParams(greedy=True, temperature=0.0).greedy  # unused when greedy
    assert SamplingParams(greedy=False, top_p=np.float32(0.5)).top_p == 0.5


@pytest.mark.parametrize("prompt", [
    [1.7, 2.9],
    [1, 2.0],
    np.array([1.7, 2.9]),
    np.array([1.0, 2.0], dtype=np.float32),
    torch.tensor([1.7, 2.9]),
    torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    [torch.tensor(1.7), torch.tensor(2.0)],
    [np.float64(1.0)],
    np.array([True, False]),
    torch.tensor([True, False]),
    [np.bool_(True)],
    torch.tensor([[1, 2]]),
    np.array([[1, 2]]),
    [torch.tensor([1, 2])],
    "12",
    None,
])
def test_prompts_of_non_integer_ids_are_refused_not_truncated(prompt):
    with pytest.raises(ValueError, match="prompt 0"):
        check_batch([prompt], None, vocab_size=256)


@pytest.mark.parametrize("prompt", [
    [1, 2, 3],
    (1, 2, 3),
    [np.int64(1), np.int32(2), 3],
    np.array([1, 2, 3], dtype=np.int64),
    np.array([1, 2, 3], dtype=np.uint8),
    torch.tensor([1, 2, 3]),
    torch.tensor([1, 2, 3], dtype=torch.int32),
    [torch.tensor(1), torch.tensor(2)],
])
def test_prompts_of_integer_ids_are_accepted(prompt):
    assert check_batch([prompt, [5]], None, vocab_size=256) == [SamplingParams()] * 2


@pytest.mark.parametrize("prompt, match", [
    (np.array([1, 300]), "outside the vocabulary"),
    (torch.tensor([-1]), "outside the vocabulary"),
    (np.array([], dtype=np.int64), "empty"),
    (torch.tensor([], dtype=torch.long), "empty"),
])
def test_array_prompts_get_the_same_range_checks(prompt, match):
    with pytest.raises(ValueError, match=match):
        check_batch([prompt], None, vocab_size=256)


@pytest.mark.parametrize("model", [
    torch.nn.Linear(2, 2),
    object(),
    None,
    SimpleNamespace(config=SimpleNamespace(model_type="llama")),
    SimpleNamespace(config=SimpleNamespace(model_type="deepseek_v4")),  # not a module
])
def test_a_model_that_is_not_deepseek_v4_is_refused(model):
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        model_layout(model, 16)
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        Engine.from_hf(model, CacheConfig(page_size=16, device_tokens=256))


@pytest.fixture(scope="module")
def engine():
    return Engine.from_hf(tiny_model(), CacheConfig(page_size=16, device_tokens=256))


@pytest.mark.parametrize("prompts", [
    [[1.7, 2.9]],
    [np.array([1.7, 2.9])],
    [torch.tensor([1.7, 2.9])],
])
def test_the_engine_refuses_float_prompts(engine, prompts):
    with pytest.raises(ValueError, match="integer"):
        engine.generate(prompts, SamplingParams(max_new_tokens=1))
