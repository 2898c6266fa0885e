"""`llmbus bench`: a load generator for any TGI- or OpenAI-compatible server.

Library use: ``from llmbus.bench import BenchConfig, run_bench``; ``run_bench(BenchConfig(url=...,
concurrency=[1, 64]))`` returns a ``BenchResult`` (per-level stats and every request's samples).

The names load on first use: every `llmbus` command imports this package (the CLI registers `bench`),
and serving should not pay for aiohttp client code it never runs.
"""

_EXPORTS = {"BenchConfig": "loadgen", "BenchResult": "loadgen", "BenchError": "loadgen",
            "LevelResult": "loadgen", "run_bench": "loadgen", "Sample": "stats"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'llmbus.bench' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"llmbus.bench.{_EXPORTS[name]}"), name)
