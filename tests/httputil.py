"""Kept while the test files move to importing ``llmbus.testing.http`` directly: the same names, from there."""

from llmbus.testing.http import (all_blocks_free, get, metrics, parse_exposition, post, sse_events, stream,
                                 wait_for_metrics)

__all__ = ["all_blocks_free", "get", "metrics", "parse_exposition", "post", "sse_events", "stream",
           "wait_for_metrics"]
