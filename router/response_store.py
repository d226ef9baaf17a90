"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`), kept by the ingress replica that answered them, as vLLM keeps them in its
API server's memory: the most recent `max_responses`, the least recently used dropped first.

A stored response keeps its conversation whole (the earlier turns' items, its own input items,
then its output items), so a request that continues it is its conversation plus the new input:
the next turn's prompt starts with the last one's, which the target replicas' prefix cache holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # input items: earlier turns, this request's input, its output


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._responses[response_id] = stored
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
