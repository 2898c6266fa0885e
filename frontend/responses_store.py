"""The Responses API's store: finished responses kept in memory, most recently used last, so that
``previous_response_id`` can continue a conversation and ``GET``/``DELETE /v1/responses/{id}`` find one.

Per frontend process and never written anywhere: a restart forgets every response, and with several
frontends (``llmbus up --num-frontends N``) a follow-up must reach the frontend that answered the first turn.
Bounded by count (``--responses-store-size``): the least recently used response goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llmbus.frontend.errors import ApiError, ErrorKind


@dataclass
class StoredResponse:
    body: dict  # the response object as it was answered
    # the conversation up to and including this response's output, as chat messages (the instructions
    # left out: OpenAI does not carry them into the next turn)
    messages: list[dict]


class ResponseStore:
    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.size <= 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse:
        """The stored response (now the most recently used), or the 404 OpenAI answers."""
        item = self._items.get(response_id)
        if item is None:
            raise not_found(response_id)
        self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> None:
        if self._items.pop(response_id, None) is None:
            raise not_found(response_id)


def not_found(response_id: str) -> ApiError:
    return ApiError(ErrorKind.NOT_FOUND, f"Response with id '{response_id}' not found.", param="response_id")
