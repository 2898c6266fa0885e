"""A response's ``output`` items and its stream events, built from what the chat path produces: the text
deltas of a generation (``Choice.next_delta``), passed through the chat path's parser (``AnswerParser``:
a reasoning section, tool calls in the model's syntax), whose chat-completion deltas (reasoning, content, a
call named, argument fragments) map one to one onto OpenAI's Responses events. A whole (non-streamed)
answer is built by the same class from its whole text, so the two can never disagree.

Event order, as OpenAI's: per item ``response.output_item.added``; for a message then
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``; for a function call ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``; for a reasoning item (a thinking model's section, as vLLM and
OpenAI's open-weight models give it: ``content`` of ``reasoning_text`` parts, no summary)
``response.reasoning_text.delta``..., ``response.reasoning_text.done``; then ``response.output_item.done``.
Every event carries the stream's ``sequence_number``.
"""

from __future__ import annotations

import secrets

from llmbus.frontend.tools import ToolCallStream


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputBuilder:
    """Feed it text deltas, then ``finish``; ``output`` is the items, ``events`` what a stream sends
    (taken with ``take_events``), numbered from ``first_sequence``."""

    def __init__(self, tools: bool = False, first_sequence: int = 0, parser=None):
        """``parser``: an ``AnswerParser`` (reasoning and calls), else a ``ToolCallStream`` with ``tools``."""
        self.parser = parser if parser is not None else ToolCallStream() if tools else None
        self.output: list[dict] = []
        self.events: list[dict] = []
        self.sequence = first_sequence
        self._open: dict | None = None  # the item being written
        self._text = ""  # the open message's text so far

    def event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def take_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    # --- input --------------------------------------------------------------------------------------

    def feed(self, text: str) -> None:
        if not text:
            return
        if self.parser is None:
            self._content(text)
            return
        for delta in self.parser.feed(text):
            self._chat_delta(delta)

    def finish(self, status: str) -> None:
        """Close what is open; an answer with no output at all is one empty message, as OpenAI's."""
        if self.parser is not None:
            for delta in self.parser.finish():
                self._chat_delta(delta)
        if not any(item["type"] != "reasoning" for item in self.output):  # reasoning alone is no answer
            self._close("completed")
            self._open_message()
        self._close(status)

    def _chat_delta(self, delta: dict) -> None:
        if "reasoning_content" in delta:
            self._reasoning(delta["reasoning_content"])
        if "content" in delta:
            self._content(delta["content"])
        for call in delta.get("tool_calls", []):
            fn = call["function"]
            if "name" in fn:
                self._open_call(call["id"], fn["name"])
            if fn.get("arguments"):
                self._open["arguments"] += fn["arguments"]
                self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                           output_index=len(self.output) - 1, delta=fn["arguments"])

    # --- items --------------------------------------------------------------------------------------

    def _content(self, text: str) -> None:
        if self._open is None or self._open["type"] != "message":
            self._close("completed")
            self._open_message()
        self._text += text
        self.event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                   content_index=0, delta=text, logprobs=[])

    def _reasoning(self, text: str) -> None:
        if self._open is None or self._open["type"] != "reasoning":
            self._close("completed")
            self._open = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                          "status": "in_progress"}
            self._text = ""
            self.output.append(self._open)
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(self._open))
        self._text += text
        self.event("response.reasoning_text.delta", item_id=self._open["id"], output_index=len(self.output) - 1,
                   content_index=0, delta=text)

    def _open_message(self) -> None:
        self._open = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                      "content": []}
        self._text = ""
        self.output.append(self._open)
        self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(self._open))
        self.event("response.content_part.added", item_id=self._open["id"], output_index=len(self.output) - 1,
                   content_index=0, part=_text_part(""))

    def _open_call(self, call_id: str, name: str) -> None:
        self._close("completed")
        self._open = {"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                      "call_id": call_id, "name": name, "arguments": ""}
        self.output.append(self._open)
        self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(self._open))

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self.output.index(item)
        if item["type"] == "message":
            part = _text_part(self._text)
            self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=self._text, logprobs=[])
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=part)
            item["content"] = [part]
        elif item["type"] == "reasoning":
            self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=self._text)
            item["content"] = [{"type": "reasoning_text", "text": self._text}]
        else:
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        item["status"] = status
        self.event("response.output_item.done", output_index=index, item=dict(item))
