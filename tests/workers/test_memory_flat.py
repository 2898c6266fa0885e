"""Issue #36: a worker's memory stays flat under every kind of request.

Two cheap regressions of what the long soak (benchmarks/soak.py --mode mixed) measures:

- every per-request object rank 0 holds (token histories, grammar matchers, prompt-logprob rows, the
  requests' own states) goes when its request is dropped: many requests of each kind, interleaved, with
  chunked prompts, speculation and preemptions, and the counter (workers/process.py ``runner_request_state``)
  is back at its idle value, twice over, after having counted them while they ran;
- oneDNN's caches of GEMMs built per row count are bounded (workers/host_memory.py ``bound_onednn_caches``):
  glibc's in-use bytes after 96 new row counts, with the bound and without it (oneDNN's default), in a
  process of its own since both caches read their capacity once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmbus.bus.messages import Grammar, SamplingParams
from llmbus.testing.runner_driver import Request, drive
from llmbus.workers.process import runner_request_state

IDLE = {"histories": 0, "prompt_logprob_rows": 0, "grammar_matchers": 0, "draft_guesses": 0, "encoded_images": 0}

KINDS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, seed=7, temperature=0.8, top_p=0.9, top_k=40),
    "min_p_typical": SamplingParams(do_sample=True, seed=3, min_p=0.05, typical_p=0.9),
    "penalties": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "top_n": SamplingParams(top_n_tokens=5),
    "watermark": SamplingParams(do_sample=True, seed=5, watermark=True),
}
GRAMMARS = [Grammar("regex", "[0-9]{3,6}"),
            Grammar("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"], "additionalProperties": False}))]


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    from llmbus.workers.model_runner import ModelRunner

    return ModelRunner(str(tiny_model_dir), dtype=torch.float32, block_size=4, num_blocks=400)


def _requests(round_: int, vocab: int) -> list[Request]:
    """Every kind several times, arriving over the first steps; some chunked, speculating or preempted."""
    out = []
    for i in range(24):
        name = list(KINDS)[i % len(KINDS)]
        prompt = [(17 * i + 5 * j + round_) % vocab for j in range(3 + i % 9)]
        out.append(Request(
            f"{round_}-{i}-{name}", prompt, KINDS[name], arrival_step=i // 3, max_new_tokens=6 + i % 5,
            prefill_chunk=4 if i % 4 == 1 else None,
            grammar=GRAMMARS[i % 2] if i % 3 == 2 else None,
            speculate=3 if i % 4 == 3 else 0, oracle=[(7 * i + k) % vocab for k in range(32)] if i % 4 == 3 else [],
            preempt_after=2 if i % 5 == 4 else None))
    return out


def test_per_request_state_returns_to_idle(runner):
    peak = dict(IDLE)
    launch = runner.launch

    def counted_launch(seqs, feed=None):
        launched = launch(seqs, feed)
        for name, n in runner_request_state(runner).items():
            peak[name] = max(peak[name], n)
        return launched

    runner.launch = counted_launch
    try:
        for round_ in range(2):
            drive(runner, _requests(round_, runner.vocab_size))
            assert runner_request_state(runner) == IDLE, f"after round {round_}"
    finally:
        del runner.launch
    # the counter counts: penalised requests' histories and grammar matchers were held while they ran
    assert peak["histories"] > 0 and peak["grammar_matchers"] > 0, peak


ONEDNN_PROBE = """
import ctypes, json, sys
import torch
from llmbus.workers.host_memory import bound_onednn_caches
from llmbus.workers.linear import Linear, onednn_packs

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
capacity = int(sys.argv[1])
bound_onednn_caches(capacity)
torch.set_num_threads(1)
weight = torch.randn(64, 64)
if not onednn_packs(weight):
    print(json.dumps(None))
    sys.exit()
linear = Linear(weight)
linear(torch.randn(8, 64))
before = mallinfo2().uordblks
for rows in range(9, 105):
    linear(torch.randn(rows, 64))
print(json.dumps((mallinfo2().uordblks - before) / 2**20))
"""


def _onednn_growth_mib(capacity: int) -> float | None:
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE, str(capacity)], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items()
                                           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_onednn_caches_are_bounded():
    if sys.platform != "linux" or not torch.backends.mkldnn.is_available():
        pytest.skip("oneDNN on glibc only")
    bounded, unbounded = _onednn_growth_mib(8), _onednn_growth_mib(1024)
    if bounded is None:
        pytest.skip("float32 projections do not go through oneDNN here (gemm.c runs them)")
    # each of oneDNN's cache entries holds ~300 KiB: 96 row counts kept are tens of MiB, 8 a few
    assert unbounded > 20, unbounded
    assert bounded < 8 and bounded < unbounded / 4, (bounded, unbounded)
