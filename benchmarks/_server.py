"""What the serving benchmarks share: `llmbus up` as a child process that is stopped whatever happens,
token streams read with each token's arrival time, /metrics samples, and prompts of an exact token count.

Not a benchmark itself (the leading underscore); import it from a script in this folder.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from harness import LineReader, descendants, free_port  # noqa: E402  (descendants: the launcher's process tree)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so `finally` blocks (and with them the server's stop) run as they
    do on Ctrl-C."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def default_model_dir() -> str:
    """The demo `small` model's folder (random weights, generated on first use)."""
    from llmbus.supervisor.demo_model import demo_model_dir

    return str(demo_model_dir("small"))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class LlmbusServer:
    """``llmbus up ARGS`` on a free local port, as a context manager: entered once the launcher prints
    its ready line, stopped on exit (SIGTERM, then wait; SIGKILL after ``stop_timeout``) whether the
    block ended normally, raised, or was interrupted, startup included. ``leftover`` lists the pids of
    the launcher's process tree still alive after the stop (it should be empty)."""

    def __init__(self, args: list[str], *, ready_timeout: float = 600.0, stop_timeout: float = 60.0,
                 env: dict[str, str] | None = None):
        self.env = env or {}  # more environment for the launcher (PYTHONPATH: another llmbus revision)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "llmbus.supervisor", "up", "--hostname", "127.0.0.1",
                    "--port", str(self.port), *args]
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.proc: subprocess.Popen | None = None
        self.stderr: LineReader | None = None
        self.pids: list[int] = []
        self.leftover: list[int] = []
        self.startup_s: float | None = None

    @property
    def command_line(self) -> str:
        return shlex.join(["llmbus", *self.cmd[3:]])

    def __enter__(self) -> LlmbusServer:
        print(f"server: {self.command_line}", flush=True)
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
            self.stderr = LineReader(self.proc.stderr)
            self.stderr.wait_for("llmbus: ready", self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        self.pids = [self.proc.pid, *descendants(self.proc.pid)]
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()
        if exc_type is not None and self.stderr is not None:  # the server's side of the story
            print("last server log lines:\n" + "\n".join(self.stderr.lines[-25:]), file=sys.stderr)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        self.pids = list(dict.fromkeys([*self.pids, self.proc.pid, *descendants(self.proc.pid)]))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.stderr is not None:
            self.stderr.join()
        deadline = time.monotonic() + 5.0  # the launcher reaps its children before it exits; margin
        while [p for p in self.pids if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftover = [p for p in self.pids if _alive(p)]
        return self.proc.returncode

    def log_lines(self, *needles: str) -> list[str]:
        """Server stderr lines containing any of ``needles`` (case-insensitive)."""
        lines = self.stderr.lines if self.stderr is not None else []
        return [line for line in lines if any(n.lower() in line.lower() for n in needles)]


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


def load_average() -> str:
    """The 1/5/15-minute load averages: how busy the machine was, to judge the numbers by."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


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
