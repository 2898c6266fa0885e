"""A frontend played with raw sockets, for tests of the scheduler and ranks as real processes: what they are
given and answer is the bus contract itself (handshake, events, stats), with no HTTP in between; and the
tokens the fake runner (``--runner fake``) gives a prompt."""

from __future__ import annotations

import time

import zmq

from llmbus.bus import messages as m
from llmbus.bus.rundir import RunDir
from llmbus.bus.sockets import open_socket, recv, send
from llmbus.workers.fake import FakeRunner


class RawFrontend:
    def __init__(self, run_dir: RunDir, frontend_id: str):
        self.ctx = zmq.Context()
        self.id = frontend_id
        self.events_endpoint = run_dir.endpoints.frontend_events(run_dir.path, frontend_id)
        self.events = open_socket(self.ctx, zmq.PULL, self.events_endpoint)
        self.requests = open_socket(self.ctx, zmq.PUSH, run_dir.endpoints.requests)
        send(self.requests, m.FrontendHello(frontend_id, self.events_endpoint))
        self.stats: m.SchedulerStats | None = None
        self.hello = self.next_event(timeout=30)
        assert isinstance(self.hello, m.SchedulerHello)

    def next_event(self, timeout: float = 30):
        """The next event other than SchedulerStats (those are kept in ``self.stats``)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            assert self.events.poll(int(remaining * 1000)), "no event from the scheduler"
            msg = recv(self.events)
            if not isinstance(msg, m.SchedulerStats):
                return msg
            self.stats = msg

    def wait_for_idle_stats(self, timeout: float = 30) -> m.SchedulerStats:
        """Stats until one shows an empty queue and batch (sent whenever the scheduler goes idle)."""
        deadline = time.monotonic() + timeout
        while self.stats is None or self.stats.batch_size or self.stats.queue_size:
            remaining = max(0.0, deadline - time.monotonic())
            assert self.events.poll(int(remaining * 1000)), f"scheduler never reported idle: {self.stats}"
            msg = recv(self.events)
            if isinstance(msg, m.SchedulerStats):
                self.stats = msg
        return self.stats

    def add(self, rid: str, prompt: list[int], max_new_tokens: int, eos: list[int] = ()):
        send(self.requests, m.AddRequest(f"{self.id}-{rid}", self.id, prompt, m.SamplingParams(),
                                         m.StoppingParams(max_new_tokens, list(eos))))

    def collect(self, n_requests: int, timeout: float = 60):
        """Tokens per request until n_requests finished; also the number of TokenBatch messages."""
        tokens, reasons, batches = {}, {}, 0
        deadline = time.monotonic() + timeout
        while len(reasons) < n_requests:
            ev = self.next_event(deadline - time.monotonic())
            assert isinstance(ev, m.TokenBatch), ev
            batches += 1
            for rid, tok, fin in zip(ev.rids, ev.token_ids, ev.finish_reasons):
                tokens.setdefault(rid, []).append(tok)
                if fin:
                    reasons[rid] = m.FinishReason(fin)
        return tokens, reasons, batches

    def close(self):
        self.events.close(0)
        self.requests.close(0)
        self.ctx.term()


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    fake = FakeRunner()
    out, last, pos = [], prompt[-1], len(prompt)
    for _ in range(n):
        last = fake.next_token(last, pos)
        out.append(last)
        pos += 1
    return out
