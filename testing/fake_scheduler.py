"""A fake scheduler and the real aiohttp frontend in front of it, for the frontend's tests (real sockets:
zmq ipc + HTTP on localhost), and the tiny byte-level BPE model folder they serve.

The fake scheduler is a thread with real zmq sockets: it answers FrontendHello with SchedulerHello and
each AddRequest with a scripted reply in TokenBatch messages (three tokens per batch, one emoji split
into its four UTF-8 bytes, EOS at the end), and records what it receives. Like the real one it sends
SchedulerStats as a heartbeat (the latest a test sent, or zeros) until it says EngineDead. Words in the
prompt pick the script: HOLD (wait for ``release``), FAIL (RequestFailed). ``Frontend`` runs
``llmbus.frontend.app.serve`` in a thread with its own event loop, in front of a FakeScheduler.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import queue
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from llmbus.bus import messages as m
from llmbus.bus.sockets import open_socket, recv, send
from llmbus.frontend.app import serve
from llmbus.frontend.config import FrontendConfig
from llmbus.frontend.token_pieces import byte_to_unicode

WAIT = 10.0  # seconds any condition may take before a test fails
BOS, EOS = 0, 1
REPLY = "Hello wörld 🙂 日本語 done"


# ------------------------------------------------------------------------------------------------
# A tiny byte-level BPE model folder
# ------------------------------------------------------------------------------------------------


def build_model_dir(path: Path) -> Path:
    rng = random.Random(0)
    words = ["hello", "world", "Hello", "wörld", "the", "quick", "brown", "fox", "café", "naïve",
             "日本語", "done", "jumps", "over", "lazy", "dog", "🙂", "stop", "here"]
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    assert tok.token_to_id("<s>") == BOS and tok.token_to_id("</s>") == EOS
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "model_max_length": 1000000000000000019884624838656}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    return path


def reply_ids(tok: Tokenizer) -> list[int]:
    """REPLY as token ids, with the emoji as four single-byte tokens (a char split across tokens)."""
    b2u = byte_to_unicode()
    head, tail = REPLY.split(" 🙂")
    ids = tok.encode(head, add_special_tokens=False).ids
    ids.append(tok.token_to_id(b2u[ord(" ")]))
    ids += [tok.token_to_id(b2u[b]) for b in "🙂".encode()]
    ids += tok.encode(tail, add_special_tokens=False).ids
    assert tok.decode(ids) == REPLY and None not in ids
    return ids



# ------------------------------------------------------------------------------------------------
# The fake scheduler
# ------------------------------------------------------------------------------------------------


class FakeScheduler:
    TOKENS_PER_BATCH = 3

    def __init__(self, endpoint: str, model_dir: Path, max_batch_total_tokens: int = 100_000):
        self.endpoint = endpoint
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.reply = reply_ids(self.tok)
        self.max_batch_total_tokens = max_batch_total_tokens
        self.adds: dict[str, m.AddRequest] = {}
        self.aborts: list[str] = []
        self.fail_generations = False  # fail every request with a generation error
        self.cached_tokens = 0  # the prompt tokens each request's first batch says the prefix cache held
        self.health = "ok"  # how HealthChecks are answered: "ok", "fail" (a rank missed the probe), "silent"
        self.health_checks: list[m.HealthCheck] = []
        self.frontend_stats: list[m.FrontendStats] = []
        self.hellos: list[m.FrontendHello] = []
        self.heartbeat = True
        self.stats = m.SchedulerStats(0, 0, 0, 0, 0, 16)
        self._heartbeat_at = 0.0
        self.cond = threading.Condition()
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pull = open_socket(self._ctx, zmq.PULL, endpoint)
        self._push = None
        self._held: dict[str, m.AddRequest] = {}
        self._thread = threading.Thread(target=self._run, name="fake-scheduler", daemon=True)
        self._thread.start()

    # test-side API
    def wait_for(self, predicate, what: str):
        with self.cond:
            assert self.cond.wait_for(predicate, timeout=WAIT), f"fake scheduler: timed out waiting for {what}"

    def release(self, rid: str) -> None:
        self._commands.put(("release", rid))

    def engine_dead(self, reason: str) -> None:
        self._commands.put(("dead", reason))

    def send_event(self, msg: m.Message) -> None:
        self._commands.put(("send", msg))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)
        self._pull.close()
        if self._push is not None:
            self._push.close()
        self._ctx.term()

    # scheduler thread
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._pull.poll(10):
                msg = recv(self._pull)
                if msg is not None:
                    self._handle(msg)
            while not self._commands.empty():
                cmd, arg = self._commands.get()
                if cmd == "release":
                    self._answer(self._held.pop(arg))
                elif cmd == "dead":
                    self.heartbeat = False
                    send(self._push, m.EngineDead(reason=arg))
                elif cmd == "send":
                    if isinstance(arg, m.SchedulerStats):
                        self.stats = arg
                    send(self._push, arg)
            if self.heartbeat and self._push is not None and time.monotonic() - self._heartbeat_at >= 0.25:
                self._heartbeat_at = time.monotonic()
                send(self._push, self.stats)

    def _handle(self, msg) -> None:
        with self.cond:  # record first: the frontend may answer its client as soon as we reply
            if isinstance(msg, m.FrontendHello):
                self.hellos.append(msg)
            elif isinstance(msg, m.AddRequest):
                self.adds[msg.rid] = msg
            elif isinstance(msg, m.AbortRequest):
                self.aborts.extend(msg.rids)
            elif isinstance(msg, m.HealthCheck):
                self.health_checks.append(msg)
            elif isinstance(msg, m.FrontendStats):
                self.frontend_stats.append(msg)
            self.cond.notify_all()
        if isinstance(msg, m.FrontendHello):
            self._push = open_socket(self._ctx, zmq.PUSH, msg.events_endpoint, linger_ms=1000)
            send(self._push, m.SchedulerHello(max_batch_total_tokens=self.max_batch_total_tokens, block_size=16))
        elif isinstance(msg, m.HealthCheck) and self.health != "silent":
            send(self._push, m.HealthReply(msg.check_id, self.health == "ok",
                                           "" if self.health == "ok" else "worker rank(s) 1 did not answer"))
        elif isinstance(msg, m.AddRequest):
            prompt = self.tok.decode(msg.input_ids)
            if "HOLD" in prompt:
                self._held[msg.rid] = msg
            elif "GENFAIL" in prompt or self.fail_generations:
                send(self._push, m.RequestFailed(rid=msg.rid, error_type="generation", message="shard broke"))
            elif "FAIL" in prompt:
                send(self._push, m.RequestFailed(rid=msg.rid, error_type="validation", message="bad thing"))
            else:
                self._answer(msg)

    def _answer(self, req: m.AddRequest) -> None:
        ids = self.reply + [EOS]
        # the request's own stop ids (vLLM's stop_token_ids) end the reply at the first one past min_tokens
        stop = next((i for i, t in enumerate(ids) if t in req.stopping.request_stop_ids
                     and i >= req.sampling.min_new_tokens), None)
        ids = ids[:req.stopping.max_new_tokens if stop is None else min(stop + 1, req.stopping.max_new_tokens)]
        reasons = [m.FinishReason.NONE] * len(ids)
        reasons[-1] = (m.FinishReason.LENGTH if len(ids) == req.stopping.max_new_tokens
                       else m.FinishReason.EOS_TOKEN)
        n_top = req.sampling.top_n_tokens
        for start in range(0, len(ids), self.TOKENS_PER_BATCH):
            part = range(start, min(start + self.TOKENS_PER_BATCH, len(ids)))
            batch = m.TokenBatch(
                rids=[req.rid] * len(part), token_ids=[ids[i] for i in part],
                logprobs=[-0.25 * (i + 1) for i in part], finish_reasons=[int(reasons[i]) for i in part],
                top_tokens=[[[ids[i]] + [EOS] * (n_top - 1), [-0.25 * (i + 1)] + [-5.0] * (n_top - 1)]
                            for i in part] if n_top else [],
                # each prompt token after the first at -1.5, and the top of its position, when asked: it, then EOS
                prompt_logprobs=([[req.rid, [-1.5] * (len(req.input_ids) - 1),
                                   [[[t] + [EOS] * (n_top - 1), [-1.5] + [-5.0] * (n_top - 1)]
                                    for t in req.input_ids[1:]] if n_top else []]]
                                 if start == 0 and req.prompt_logprobs else []),
                queue_times=[0.002 if i == 0 else 0.0 for i in part],
                cached_tokens=[[req.rid, self.cached_tokens]] if start == 0 and self.cached_tokens else [])
            send(self._push, batch)


# ------------------------------------------------------------------------------------------------
# The frontend under test, in a thread with its own event loop
# ------------------------------------------------------------------------------------------------


class Frontend:
    def __init__(self, model_dir: Path, transport: str = "ipc", **overrides):
        """``transport``: the bus's, ``ipc`` (the scheduler's pid is known to the frontend) or ``tcp``."""
        self.dir = tempfile.mkdtemp(prefix="llmbus-fe-", dir="/tmp")
        if transport == "tcp":
            from llmbus.testing.server import free_port

            requests, events = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
        else:
            requests, events = f"ipc://{self.dir}/requests.sock", f"ipc://{self.dir}/events-fe1.sock"
        self.sched = FakeScheduler(requests, model_dir)
        cfg = dict(model_dir=str(model_dir), model_id="tiny-test", hostname="127.0.0.1", port=0,
                   requests_endpoint=requests, events_endpoint=events,
                   frontend_id="fe1", max_input_tokens=40, max_total_tokens=64, scheduler_timeout_s=WAIT,
                   shutdown_timeout_s=1.0, enable_prefill_logprobs=True)
        cfg.update(overrides)
        self.config = FrontendConfig(**cfg)
        self.url = None
        self.error = None
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="frontend", daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT), "frontend did not start"
        if self.error:
            raise self.error
        self.host, self.port = "127.0.0.1", int(self.url.rsplit(":", 1)[1])

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        def ready(url):
            self.url = url
            self._ready.set()
        try:
            self._loop.run_until_complete(serve(self.config, on_ready=ready, stop=self._stop, abort=self._abort,
                                                install_signals=False))
        except Exception as e:  # noqa: BLE001 - reported to the test thread
            self.error = e
            self._ready.set()
        finally:
            self._loop.close()

    def request_stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)

    def request_abort(self) -> None:
        self._loop.call_soon_threadsafe(self._abort.set)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT)
        assert not self._thread.is_alive(), "frontend did not stop"
        self.sched.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # HTTP helpers (stdlib only)
    def request(self, method: str, path: str, body=None, headers=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=WAIT)
        try:
            if body is not None and not isinstance(body, (bytes, str)):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers=headers or {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, body):
        status, headers, raw = self.request("POST", path, body)
        return status, headers, (json.loads(raw) if raw else None)


# ------------------------------------------------------------------------------------------------
# What the tests send and read back
# ------------------------------------------------------------------------------------------------


def parse_sse(raw: bytes) -> list[dict]:
    """Events of an SSE body; asserts TGI's exact framing."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    events = []
    for chunk in raw[:-2].split(b"\n\n"):
        if chunk == b":":
            continue  # keep-alive
        assert chunk.startswith(b"data: "), chunk
        obj = json.loads(chunk[len(b"data: "):])
        assert chunk[len(b"data: "):] == json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
        events.append(obj)
    return events


def last_rid(fe: Frontend) -> str:
    with fe.sched.cond:
        return list(fe.sched.adds)[-1]


def last_add(fe: Frontend) -> m.AddRequest:
    """The AddRequest the fake scheduler received last."""
    with fe.sched.cond:
        return list(fe.sched.adds.values())[-1]


def chat(fe, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return fe.post("/v1/chat/completions", body)

