"""/tokenize in vLLM's and llama.cpp's shapes beside TGI's, and /detokenize: scripts written for those servers count
and read tokens through them.

POST /tokenize is TGI's (``{"inputs"}`` -> its token spans, routes.py) unless the body names no ``inputs`` and
one of ``prompt`` or ``messages`` (vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}``, the messages
rendered as /v1/chat/completions renders them) or ``content`` (llama.cpp's: ``{"tokens"}``, with
``with_pieces`` each ``{"id", "piece"}``). vLLM's answer carries ``tokens`` too, so a llama.cpp client reads it
as well. POST /detokenize takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}`` (vLLM) with
``"content"`` (llama.cpp) beside it; special tokens are kept, as both servers keep them.
"""

from __future__ import annotations

from aiohttp import web

from llmbus.frontend.errors import validation_error
from llmbus.frontend.openai_requests import body_field, is_token_id, parse_chat, read_json_object
from llmbus.frontend.openai_routes import chat_format, chat_prompt
from llmbus.frontend.state import STATE, json_response


def other_shape(body) -> bool:
    """Whether a /tokenize body is vLLM's or llama.cpp's rather than TGI's."""
    return isinstance(body, dict) and "inputs" not in body and any(k in body for k in ("prompt", "messages",
                                                                                          "content"))


def _text(body: dict, name: str) -> str:
    """The body's text to tokenize: present (the shape was chosen by it), so null is no text either."""
    if not isinstance(body[name], str):
        raise validation_error(f"`{name}` must be a string", param=name)
    return body[name]


async def tokenize_other(request: web.Request, body: dict) -> web.Response:
    state = request.app[STATE]
    if "content" in body:  # llama.cpp's
        text = _text(body, "content")
        ids = await state.generator.off_loop(state.tokenizer.encode, text,
                                             body_field(body, "add_special", "boolean", False))
        if body_field(body, "with_pieces", "boolean", False):
            return json_response({"tokens": [{"id": i, "piece": piece}
                                             for i, piece in zip(ids, state.tokenizer.token_texts(ids))]})
        return json_response({"tokens": ids})
    if "messages" in body:  # vLLM's chat shape: the template rendered as the chat route renders it
        chat = parse_chat(body, state.limits, state.config.max_client_batch_size, state.sampling_defaults,
                          chat_format(state))
        text, special = chat_prompt(state, chat), body_field(body, "add_special_tokens", "boolean", False)
    else:
        text = _text(body, "prompt")
        special = body_field(body, "add_special_tokens", "boolean", True)
    text, _ = await state.generator.expand_images(text)  # a vision model's images: their placeholder tokens
    ids = await state.generator.off_loop(state.tokenizer.encode, text, special)
    strs = state.tokenizer.token_texts(ids) if body_field(body, "return_token_strs", "boolean", False) else None
    return json_response({"count": len(ids), "max_model_len": state.limits.max_total_tokens, "tokens": ids,
                          "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = read_json_object(await request.read(), "DetokenizeRequest")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_token_id(t) for t in ids):
        raise validation_error("`tokens` must be an array of token ids (integers >= 0)", param="tokens")
    state.tokenizer.known_ids(ids, param="tokens")
    text = state.tokenizer.tokenizer.decode(ids, skip_special_tokens=False)
    return json_response({"prompt": text, "content": text})
