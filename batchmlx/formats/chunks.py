"""The chunk objects of one streamed completion (`stream: true`), as OpenAI sends them."""

from __future__ import annotations

from typing import Any

from batchmlx.formats.openai import IdPrefix, new_id
from batchmlx.formats.request import Endpoint


class StreamChunks:
    """Builds the chunk objects of one streamed response: one id and `created` for all."""

    def __init__(self, endpoint: Endpoint, model: str, *, created: int) -> None:
        self.chat = endpoint is Endpoint.CHAT
        self.id = new_id(IdPrefix.CHAT_COMPLETION if self.chat else IdPrefix.COMPLETION)
        self.created = created
        self.model = model

    def _wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **extra,
        }

    def text(
        self, index: int, text: str, finish: str | None = None, role: bool = False
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish is None else {})  # fmt: skip
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        return self._wrap([choice])

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._wrap([], usage=usage)
