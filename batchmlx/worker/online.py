"""Online requests (the HTTP API's /v1/chat/completions and /v1/completions) sharing the worker's
engine with batch work.

The server submits an OnlineTicket; the worker admits it at its next tick with priority over batch
work, streams each sampled token to the ticket, and hands it the finished OpenAI body. Tickets use
negative ids so their engine request ids ("-3:0") never collide with queue rows.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

ONLINE_PRIORITY = 0  # engine priority of online requests; batch work keeps the default, 1


@dataclass(slots=True)
class TokenEvent:
    choice: int
    token_id: int


@dataclass(slots=True)
class DoneEvent:
    status_code: int  # 200, or the error's status
    body: dict[str, Any]  # the completion body, or {"error": {...}}


@dataclass(eq=False)
class OnlineTicket:
    """One online request. Read `events` until a DoneEvent arrives."""

    id: int  # negative
    endpoint: str
    body: dict[str, Any]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    decode: Any = None  # set by the worker: token ids -> text, with the serving tokenizer
    model: str = ""  # set by the worker: the model name response bodies give
    submitted_at: float = 0.0


class OnlineQueue:
    """The hand-off between the server's request handlers and the worker loop (one event loop)."""

    def __init__(self) -> None:
        self._ids = itertools.count(-1, -1)
        self._waiting: deque[OnlineTicket] = deque()
        self._live: dict[int, OnlineTicket] = {}
        self._wake = asyncio.Event()

    def submit(self, endpoint: str, body: dict[str, Any], now: float = 0.0) -> OnlineTicket:
        ticket = OnlineTicket(next(self._ids), endpoint, body, submitted_at=now)
        self._waiting.append(ticket)
        self._wake.set()
        return ticket

    def drain(self) -> list[OnlineTicket]:
        out = list(self._waiting)
        self._waiting.clear()
        for t in out:
            self._live[t.id] = t
        return out

    @staticmethod
    def owns(row_id: int) -> bool:
        return row_id < 0

    def get(self, ticket_id: int) -> OnlineTicket | None:
        return self._live.get(ticket_id)

    def token(self, ticket_id: int, choice: int, token_id: int) -> None:
        t = self._live.get(ticket_id)
        if t is not None:
            t.events.put_nowait(TokenEvent(choice, token_id))

    def done(self, ticket_id: int, status_code: int, body: dict[str, Any]) -> None:
        t = self._live.pop(ticket_id, None)
        if t is not None:
            t.events.put_nowait(DoneEvent(status_code, body))

    def fail_all(self, status_code: int, body: dict[str, Any]) -> int:
        """End every waiting and running ticket with an error (the worker stopped): a caller
        gets an error response, never a hang. Returns how many."""
        tickets = [*self._waiting, *self._live.values()]
        self._waiting.clear()
        self._live.clear()
        for t in tickets:
            t.events.put_nowait(DoneEvent(status_code, body))
        return len(tickets)

    def cancel(self, ticket: OnlineTicket) -> None:
        """The client went away: forget the ticket (the worker aborts its engine requests)."""
        if ticket in self._waiting:
            self._waiting.remove(ticket)
        self._live.pop(ticket.id, None)

    @property
    def live_ids(self) -> list[int]:
        return list(self._live)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    async def wait(self, timeout: float) -> None:
        """Sleep up to `timeout`, waking at once when a ticket arrives."""
        self._wake.clear()
        if self._waiting:
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except TimeoutError:
            pass
