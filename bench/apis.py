"""The two wire dialects the load generator speaks: TGI's ``/generate_stream`` and OpenAI's streaming
``/v1/completions``. Each turns one request into a filled ``Sample``: the time of every token event,
the token count, and an error text instead of an exception when anything goes wrong.

OpenAI's completions route rather than chat: a chat template wraps the prompt in tokens the load
generator cannot see, so prompt lengths would no longer be what was asked for.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from llmbus.bench.stats import Sample

_ERROR_CHARS = 200  # an error text is a table cell and a JSON value, not a log


class StreamError(Exception):
    """The server reported an error inside the stream, or the stream stopped short."""


def error_message(answer: dict) -> str:
    """The message of an error object in TGI's shape (``{"error": "..."}``) or OpenAI's
    (``{"error": {"message": "..."}}``)."""
    err = answer.get("error", answer)
    return str(err.get("message", err) if isinstance(err, dict) else err)


def error_text(status: int, body: str) -> str:
    """``HTTP 422: <message>`` from an error answer, or its raw text when it is not JSON."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    message = error_message(answer) if isinstance(answer, dict) else body
    return f"HTTP {status}: {message}"[:_ERROR_CHARS]


async def sse_events(resp: aiohttp.ClientResponse):
    """The JSON payload of each ``data:`` line; stops at OpenAI's ``[DONE]``. Comments (keep-alives)
    and blank lines are skipped."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


class Api:
    """One dialect bound to a base URL and an aiohttp session."""

    path = ""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, *, ignore_eos: bool, timeout: float,
                 model: str | None = None):
        self.session, self.base_url, self.model = session, base_url, model
        self.ignore_eos = ignore_eos
        self.timeout = aiohttp.ClientTimeout(total=timeout)

    def body(self, prompt: str, max_new_tokens: int) -> dict:
        raise NotImplementedError

    async def read(self, resp: aiohttp.ClientResponse, sample: Sample, sent: float) -> None:
        raise NotImplementedError

    async def _post(self, sample: Sample, prompt: str, sent: float) -> None:
        async with self.session.post(self.base_url + self.path, json=self.body(prompt, sample.max_new_tokens),
                                     timeout=self.timeout) as resp:
            if resp.status != 200:
                sample.error = error_text(resp.status, await resp.text())
                return
            await self.read(resp, sample, sent)

    async def send(self, sample: Sample, prompt: str, sent: float) -> None:
        """POST the request and read its stream into ``sample``; every failure ends as ``sample.error``
        (cancellation, by the run's own deadline, still propagates)."""
        try:
            for attempt in range(2):
                try:
                    await self._post(sample, prompt, sent)
                    break
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                    # A server that closed an idle keep-alive connection (llama-server does) fails the
                    # request that reuses it before a byte is read: send it once more, on a new one.
                    if attempt or sample.token_times:
                        raise
        except asyncio.TimeoutError:
            sample.error = f"timeout: not finished within {self.timeout.total:g} s"
        except StreamError as e:
            sample.error = str(e)[:_ERROR_CHARS]
        except Exception as e:  # noqa: BLE001 - a failed request is a counted sample, never the end of the run
            sample.error = f"{type(e).__name__}: {e}"[:_ERROR_CHARS]
        # not in a `finally`: a cancelled request (the run's deadline) keeps e2e None, unfinished
        sample.e2e = time.perf_counter() - sent


class TgiApi(Api):
    """``POST /generate_stream``: one event per token; the last carries ``generated_text`` and, with
    ``details``, the token counts, which are recorded as the server's own."""

    path = "/generate_stream"

    def body(self, prompt: str, max_new_tokens: int) -> dict:
        parameters = {"max_new_tokens": max_new_tokens, "do_sample": False, "details": True}
        if self.ignore_eos:
            parameters["ignore_eos_token"] = True
        return {"inputs": prompt, "parameters": parameters}

    async def read(self, resp: aiohttp.ClientResponse, sample: Sample, sent: float) -> None:
        finished = False
        async for event in sse_events(resp):
            if "error" in event:
                raise StreamError(f"in-band error: {error_message(event)}")
            if event.get("token") is not None:
                sample.token_times.append(time.perf_counter() - sent)
            if event.get("generated_text") is not None:
                finished = True
                details = event.get("details") or {}
                sample.prompt_tokens = details.get("input_length", sample.prompt_tokens)
        if not finished:
            raise StreamError("stream ended before its final event")
        sample.output_tokens = len(sample.token_times)


class OpenAIApi(Api):
    """``POST /v1/completions`` with ``stream`` and ``stream_options.include_usage``: a chunk may carry
    several tokens (a server can hold back text that is not yet valid UTF-8), so the token count comes
    from the closing ``usage`` chunk, and from the chunk count only where a server sends no usage."""

    path = "/v1/completions"

    def body(self, prompt: str, max_new_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and llmbus's extension; OpenAI itself has no such knob
        return body

    async def read(self, resp: aiohttp.ClientResponse, sample: Sample, sent: float) -> None:
        usage = None
        finished = False
        async for event in sse_events(resp):
            if "error" in event:
                raise StreamError(f"in-band error: {error_message(event)}")
            for choice in event.get("choices") or []:
                if choice.get("text"):
                    sample.token_times.append(time.perf_counter() - sent)
                finished = finished or choice.get("finish_reason") is not None
            usage = event.get("usage") or usage
        if not finished:
            raise StreamError("stream ended without a finish_reason")
        if usage:
            sample.output_tokens = usage.get("completion_tokens", len(sample.token_times))
            sample.prompt_tokens = usage.get("prompt_tokens", sample.prompt_tokens)
        else:
            sample.output_tokens = len(sample.token_times)


API_CLASSES = {"tgi": TgiApi, "openai": OpenAIApi}
