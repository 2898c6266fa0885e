"""What llmbus's tests and benchmarks share: the one launcher of a real `llmbus up` (``Server``), its
ranks' pids (what else /proc says is ``llmbus.bus.procfs``'s), a stand-in for the supervisor's channel, and
stdlib HTTP helpers.

Installed with the package (as ``llmbus.testing``), so tests and benchmarks import it by name instead of
putting each other's folders on ``sys.path``. Nothing here is used when serving.

The rest is imported by module, as each needs its own dependencies (torch, transformers, the frontend):
``fake_scheduler`` (the frontend's tests: a scripted scheduler, the frontend in a thread, their model folder),
``runner_driver`` (a ModelRunner driven by hand against transformers), ``greedy`` (greedy tokens from
transformers and from a server), ``tiny_prompts`` (what the whole-stack tests ask the tiny model),
``policy_sim`` (a simulated worker for the policy), ``raw_frontend`` (a frontend of raw sockets for the
scheduler and ranks as processes, and the fake runner's tokens), ``gguf_files`` (GGUF files written for
tests), ``structured_cases`` (schemas and regexes for SmolLM2) and ``wire_samples`` (one of every wire
message, for the golden bytes).
"""

from llmbus.testing.http import (all_blocks_free, get, metrics, parse_exposition, post, sse_events, stream,
                                 wait_for_metrics)
from llmbus.testing.server import LineReader, Server, free_port, rank_pids, stop_all
from llmbus.testing.supervisor_socket import SupervisorSocket

__all__ = ["LineReader", "Server", "SupervisorSocket", "all_blocks_free", "free_port", "get", "metrics",
           "parse_exposition", "post", "rank_pids", "sse_events", "stop_all", "stream", "wait_for_metrics"]
