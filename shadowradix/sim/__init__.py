"""Trace replay and capacity planning over the real tree in metadata-only mode."""

from shadowradix.sim.replay import ReplayStats, replay
from shadowradix.sim.trace import TraceError, TraceRequest, bundled_trace, iter_trace, load_trace

__all__ = ["ReplayStats", "TraceError", "TraceRequest", "bundled_trace", "iter_trace",
           "load_trace", "replay"]
