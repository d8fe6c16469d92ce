"""Requests, scheduling, and the public Engine."""

from shadowradix.engine.config import CacheConfig, SamplingParams, SpecConfig
from shadowradix.engine.engine import Engine
from shadowradix.engine.request import Result

__all__ = ["CacheConfig", "Engine", "Result", "SamplingParams", "SpecConfig"]
