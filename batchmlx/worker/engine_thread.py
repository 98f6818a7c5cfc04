"""The engine's own thread: every call into the engine runs here, one at a time, in order.

As vLLM's EngineCore busy loop and llama.cpp's task thread: the asyncio loop (HTTP handlers, the
database, timers, signals) posts a call and awaits its result, and never runs a step itself, so a
long step stalls no request handler, no heartbeat and no SIGTERM. MLX keeps its streams per
thread: the model is loaded on the thread that steps it (`call` of the build), and nothing else
touches MLX state.

In: a `queue.Queue` of calls. Out: each result through `loop.call_soon_threadsafe`; what a call
wants to tell the loop meanwhile (streamed tokens, finished online requests) goes the same way,
by `post`, so it arrives in order and before the call's own result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

THREAD_NAME = "batchmlx-engine"


@dataclass(slots=True)
class _Call:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: Callable[[Any, BaseException | None], None]  # called on the engine thread


class EngineThread:
    """One daemon thread serving calls from a queue (started on first use)."""

    def __init__(self) -> None:
        self._calls: queue.Queue[_Call | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def on_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread; its result (or exception) here. Cancelling
        the await does not stop the call (a step cannot be cut short): its result is dropped."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, exc: BaseException | None) -> None:
            if fut.done():  # the awaiting task was cancelled
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        def done(result: Any, exc: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                pass

        self._put(_Call(fn, args, done))
        return await fut

    def call_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """`call` for a caller without an event loop (benchmarks, a worker loaded before it
        runs): blocks this thread until the engine thread has run `fn`."""
        if self.on_thread():
            return fn(*args)
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def done(result: Any, exc: BaseException | None) -> None:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._put(_Call(fn, args, done))
        return fut.result()

    def close(self) -> None:
        """Let the thread end after the calls already posted (it holds no lease, no socket)."""
        with self._lock:
            if self._thread is not None:
                self._calls.put(None)
                # a later call starts a fresh thread on a fresh queue
                self._calls, self._thread = queue.Queue(), None

    def _put(self, call: _Call) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, args=(self._calls,), name=THREAD_NAME, daemon=True
                )
                self._thread.start()
            self._calls.put(call)

    @staticmethod
    def _serve(calls: queue.Queue[_Call | None]) -> None:
        while (call := calls.get()) is not None:
            try:
                result = call.fn(*call.args)
            except BaseException as exc:  # handed to the awaiting side, which decides
                call.done(None, exc)
            else:
                call.done(result, None)


class Poster:
    """How the engine thread hands the loop something to do (`post(fn, *args)`): at once when
    already on the loop's thread (tests that step synchronously), else `call_soon_threadsafe`."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None

    def bind(self) -> None:
        """Bind to the running loop (the worker does when it starts)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: no one is left to tell
            pass
