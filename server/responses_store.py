"""The stored responses of POST /v1/responses (store: true): what GET /v1/responses/{id}, its input_items and
previous_response_id read. In this process's memory, at most --responses-store-size of them (0: none are
kept); the oldest goes first when a new one would be one too many. Lost when the server stops.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_STORE_SIZE = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]          # the response object, as it was answered
    input_items: list[dict[str, Any]]   # this request's input items, with ids (GET .../input_items)
    conversation: list[Any]           # the items a continuation starts from: earlier ones, input, output


class ResponseStore:
    def __init__(self, size: int = DEFAULT_STORE_SIZE) -> None:
        if size < 0:
            raise ValueError(f"responses_store_size must be at least 0, got {size}.")
        self.size = size
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, stored: StoredResponse) -> None:
        if self.size == 0:
            return
        self._stored[stored.response["id"]] = stored
        while len(self._stored) > self.size:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._stored.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None
