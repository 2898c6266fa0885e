"""TGI's response shapes, byte for byte: JSON bodies, SSE events and headers.

JSON is compact (no spaces) with raw UTF-8, like serde_json. Keys come in TGI's field order; keys TGI
skips when empty (``top_tokens``, ``best_of_sequences``) are left out. Logprobs are f32 in TGI, so they
are written with the shortest decimal that reads back as the same f32, and NaN / infinity as null.
"""

from __future__ import annotations

import json
import math
import struct

from llmbus.frontend.errors import ApiError
from llmbus.frontend.generation import Generation, TokenOut

_F32 = struct.Struct("<f")


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def f32(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    try:
        rounded = _F32.unpack(_F32.pack(value))[0]
    except OverflowError:
        return None
    # 9 significant digits always read back; a value with a shorter form is found at 6 already,
    # because %g drops trailing zeros
    for digits in range(6, 10):
        candidate = float(f"{rounded:.{digits}g}")
        if _F32.unpack(_F32.pack(candidate))[0] == rounded:
            return candidate
    return rounded


def token_json(t: TokenOut) -> dict:
    return {"id": t.id, "text": t.text, "logprob": f32(t.logprob), "special": t.special}


def _top_json(top: list[dict]) -> list[dict]:
    return [{"id": t["id"], "text": t["text"], "logprob": f32(t["logprob"]), "special": t["special"]}
            for t in top]


def prompt_tokens(gen: Generation) -> list[tuple[int, str, float | None]]:
    """``(id, text, logprob)`` of each prompt token; logprob None where the engine sent none."""
    ids = gen.prepared.input_ids
    texts = gen.generator.tokenizer.token_texts(ids)
    logprobs: list = [None] * len(ids)
    given = gen.prompt_logprobs or []
    if isinstance(given, list) and len(given) <= len(ids):
        # aligned to the end: the first prompt token has no logprob when the engine sends n - 1
        logprobs[len(ids) - len(given):] = given
    return list(zip(ids, texts, logprobs))


def prefill_json(gen: Generation) -> list[dict]:
    """The prompt tokens, only when decoder_input_details asked for them; logprob null where unknown."""
    if not gen.prepared.prompt_logprobs:
        return []
    return [{"id": i, "text": t, "logprob": f32(lp)} for i, t, lp in prompt_tokens(gen)]


def full_text(gen: Generation, return_full_text: bool) -> str:
    text = gen.generated_text
    return gen.prepared.inputs + text if return_full_text else text


def _sequence_details(gen: Generation) -> dict:
    out = {
        "finish_reason": gen.finish_reason,
        "generated_tokens": len(gen.tokens),
        "seed": gen.seed,
        "prefill": prefill_json(gen),
        "tokens": [token_json(t) for t in gen.tokens],
    }
    return out


def generate_body(gen: Generation, *, return_full_text: bool, details: bool,
                  others: list[Generation] | None = None) -> dict:
    """GenerateResponse: generated_text, and details (TGI field order) when asked."""
    body = {"generated_text": full_text(gen, return_full_text)}
    if details:
        d = _sequence_details(gen)
        if others is not None:
            seqs = []
            for other in others:
                s = {"generated_text": full_text(other, return_full_text)}
                s.update(_sequence_details(other))
                if any(t.top_tokens for t in other.tokens):
                    s["top_tokens"] = [_top_json(t.top_tokens) for t in other.tokens]
                seqs.append(s)
            d["best_of_sequences"] = seqs
        if any(t.top_tokens for t in gen.tokens):
            d["top_tokens"] = [_top_json(t.top_tokens) for t in gen.tokens]
        body["details"] = d
    return body


def stream_event(index: int, token: TokenOut, gen: Generation, *, return_full_text: bool,
                 details: bool) -> bytes:
    """One SSE event: ``data: <StreamResponse>\\n\\n``; the last one carries text and details."""
    event = {"index": index, "token": token_json(token)}
    if token.top_tokens:
        event["top_tokens"] = _top_json(token.top_tokens)
    last = token.finish_reason is not None
    event["generated_text"] = full_text(gen, return_full_text) if last else None
    event["details"] = ({"finish_reason": gen.finish_reason, "generated_tokens": len(gen.tokens),
                         "seed": gen.seed, "input_length": gen.input_length}
                        if last and details else None)
    return b"data: " + dumps(event) + b"\n\n"


def error_event(err: ApiError) -> bytes:
    return b"data: " + dumps(err.body()) + b"\n\n"


KEEPALIVE = b":\n\n"


def generate_headers(gen: Generation, compute_type: str, compute_characters: int) -> dict[str, str]:
    total = gen.timings.end - gen.prepared.start_time
    headers = {"x-compute-type": compute_type, "x-compute-time": repr(max(total, 0.0)),
               "x-compute-characters": str(compute_characters)}
    headers.update({k: str(v) for k, v in gen.timings.headers_ms(gen.prepared.start_time,
                                                                 len(gen.tokens)).items()})
    headers["x-prompt-tokens"] = str(gen.input_length)
    headers["x-generated-tokens"] = str(len(gen.tokens))
    return headers


# what a prompt's headers say of the prompt itself: counted once however many generations it has
_PROMPT_HEADERS = ("x-compute-characters", "x-prompt-tokens")


def summed_headers(gens: list[Generation], compute_type: str, prompt_of: list[int]) -> dict[str, str]:
    """Answers of several generations (OpenAI's routes: prompts, choices): each one's headers, summed, as TGI's
    completions route sums its prompts'; ``prompt_of[i]``: which prompt generation i answers (the prompt's own
    headers counted once, as ``usage`` counts it)."""
    totals: dict[str, float] = {}
    seen: set[int] = set()
    for gen, prompt in zip(gens, prompt_of):
        for key, value in generate_headers(gen, compute_type, len(gen.prepared.inputs)).items():
            if key != "x-compute-type" and not (key in _PROMPT_HEADERS and prompt in seen):
                totals[key] = totals.get(key, 0) + (float(value) if key == "x-compute-time" else int(value))
        seen.add(prompt)
    return {"x-compute-type": compute_type, **{key: repr(value) if key == "x-compute-time" else str(value)
                                               for key, value in totals.items()}}


def stream_headers(compute_type: str, compute_characters: int) -> dict[str, str]:
    return {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "x-compute-type": compute_type, "x-compute-characters": str(compute_characters),
            "X-Accel-Buffering": "no"}
