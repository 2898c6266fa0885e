"""What the serving benchmarks share beside ``llmbus.testing.Server`` (the one `llmbus up` launcher of tests
and benchmarks): token streams read with each token's arrival time, /metrics samples, and prompts of an
exact token count.

Not a benchmark itself (the leading underscore); import it from a script in this folder.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# How long a benchmark's `llmbus.testing.Server` may take to start: its model may be converted or
# dequantized on the first start (tests keep Server's shorter default).
READY_TIMEOUT_S = 600.0


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so `finally` blocks (and with them the server's stop) run as they
    do on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def default_model_dir() -> str:
    """The demo `small` model's folder (random weights, generated on first use)."""
    from llmbus.supervisor.demo_model import demo_model_dir

    return str(demo_model_dir("small"))


def metrics(url: str) -> dict[str, float]:
    """Every sample of ``/metrics`` by name, labels written into the name (``name{k="v"}``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_metrics(url: str, condition, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``condition(samples)``: the scheduler's counters reach the frontend
    asynchronously (when a request joins or leaves the batch, or the scheduler goes idle). Returns the
    last samples read, met or not once ``timeout`` passed: callers check."""
    deadline = time.monotonic() + timeout
    while True:
        samples = metrics(url)
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.02)


@dataclass
class Stream:
    """One ``/generate_stream`` call: when it was sent, when each token event arrived (perf_counter),
    and the last event (with ``details`` when asked: finish_reason, input_length, generated_tokens)."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    last: dict | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent

    @property
    def finish_reason(self) -> str | None:
        return ((self.last or {}).get("details") or {}).get("finish_reason")


def client_session():
    """An aiohttp session without a total timeout (a benchmark on a busy machine can be slow), but one
    that gives up on a stream silent for 10 minutes."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600))


async def stream_tokens(session, url: str, prompt: str, parameters: dict, *, until=None,
                        stream: Stream | None = None) -> Stream:
    """POST ``/generate_stream`` with an aiohttp ``session`` and time every token event into ``stream``
    (a new one by default; pass one to watch it fill while the request runs). ``until(stream)``, checked
    after each event, ends the read early (closing the connection aborts the request)."""
    body = {"inputs": prompt, "parameters": parameters}
    s = stream if stream is not None else Stream()
    s.sent = time.perf_counter()
    async with session.post(f"{url}/generate_stream", json=body) as resp:
        if resp.status != 200:
            s.error = f"HTTP {resp.status}: {await resp.text()}"
            return s
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            now = time.perf_counter()
            event = json.loads(line[5:])
            if "error" in event:
                s.error = event["error"]
                break
            s.times.append(now)
            s.last = event
            if until is not None and until(s):
                resp.close()
                break
    return s


# Common English words: byte-level BPE vocabularies encode each as one or two tokens.
_WORDS = ("the of and to in is was for on with as by at from city river history settlement small "
          "people market bridge north south winter summer harbour road church school council water "
          "trade grew built early later years century families village farm mill station railway "
          "house street square hall tower wall gate field forest hill valley stone brick wood "
          "ships merchants workers children war peace fire flood storm harvest festival music").split()


def exact_token_prompt(tokenizer, n_tokens: int, tag: str) -> str:
    """Text that ``tokenizer`` (a ``tokenizers.Tokenizer``; special tokens added, as the server does)
    encodes to exactly ``n_tokens`` ids. It starts with ``tag`` and continues with words drawn with
    ``tag`` as the seed, so prompts with different tags differ from their first tokens on and share no
    leading KV block."""
    rng = random.Random(tag)

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    words = [tag]
    while count(" ".join(words)) < n_tokens:
        words.extend(rng.choice(_WORDS) for _ in range(max(8, (n_tokens - count(" ".join(words))) // 2)))
    lo, hi = 1, len(words)  # the most words whose text has at most n_tokens tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if count(" ".join(words[:mid])) <= n_tokens else (lo, mid - 1)
    text = " ".join(words[:lo])
    for _ in range(4 * n_tokens):
        n = count(text)
        if n == n_tokens:
            return text
        text = text + " a" if n < n_tokens else text.rsplit(" ", 1)[0]
    raise ValueError(f"cannot build a prompt of exactly {n_tokens} tokens for tag {tag!r}")


def load_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
