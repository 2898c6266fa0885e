"""What the frontends are sent for a step's token events: one TokenBatch per frontend, and each finished
request's tracing spans."""

from __future__ import annotations

import time

from llmbus.bus import messages as m
from llmbus.bus import tracing
from llmbus.scheduler.requests import Request, TokenEvent


def token_batches(events: list[TokenEvent], top_tokens: dict[str, list] | None = None) -> dict[str, m.TokenBatch]:
    """frontend id -> the TokenBatch of its requests' ``events``; ``top_tokens``: rid -> [[ids], [logprobs]]
    ([] where the request asked for none), None when no request of the step asked."""
    per_frontend: dict[str, m.TokenBatch] = {}
    for ev in events:
        tb = per_frontend.get(ev.request.frontend_id)
        if tb is None:
            tb = per_frontend[ev.request.frontend_id] = m.TokenBatch([], [], [], [])
        req = ev.request
        # TGI's queue time: arrival to first admission, reported once, with the first token.
        first = len(req.output_ids) == 1 and req.arrival_time > 0 and req.admitted_time is not None
        tb.queue_times.append(max(req.admitted_time - req.arrival_time, 1e-6) if first else 0.0)
        if first and req.cached_tokens:
            tb.cached_tokens.append([req.rid, req.cached_tokens])
        tb.rids.append(req.rid)
        tb.token_ids.append(ev.token_id)
        tb.logprobs.append(ev.logprob)
        tb.finish_reasons.append(int(ev.finish_reason))
        if ev.prompt_logprobs is not None:
            tb.prompt_logprobs.append([ev.request.rid, ev.prompt_logprobs, ev.prompt_top_tokens or []])
        if top_tokens is not None:
            tb.top_tokens.append(top_tokens.get(req.rid, []))
        if ev.finish_reason != m.FinishReason.NONE:
            if req.traceparent:
                trace_request(req, ev.finish_reason.tgi_name)
            if req.spec_proposed:
                tb.speculation.append([req.rid, req.spec_proposed, req.spec_accepted])
    for tb in per_frontend.values():
        if not any(tb.top_tokens):
            tb.top_tokens = []  # none of this frontend's tokens asked: the list stays empty
    return per_frontend


def trace_request(req: Request, finish_reason: str) -> None:
    """The request's queue and inference spans, children of the frontend's span of it."""
    now = time.time()
    admitted = req.admitted_time if req.admitted_time is not None else now
    attributes = {"rid": req.rid, "input_length": len(req.prompt_ids), "generated_tokens": len(req.output_ids),
                  "finish_reason": finish_reason, "preemptions": req.num_preemptions}
    tracing.record_span("queue", req.arrival_time or admitted, admitted, traceparent=req.traceparent,
                        attributes={"rid": req.rid})
    if req.admitted_time is not None:
        tracing.record_span("inference", admitted, now, traceparent=req.traceparent, attributes=attributes)
