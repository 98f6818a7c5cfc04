"""Media read off the engine's thread: a request whose https or file images must be read waits
here, not in the engine, and enters it once they are read.

`InFlight.start` (on the engine thread) hands such a request to `submit` and goes on; one of
`FETCH_THREADS` fetch threads reads its parts (MediaReader.resolve: the whole fetch under one
deadline) and puts the request on the done list, then calls `on_done` (the worker wakes its
loop). The next engine round takes the done list (`take_done`) and starts those requests as any
other, so a stalled fetch delays no other request by more than one engine step.

Bounds: `FETCH_THREADS` reads at a time; at most `MAX_FETCHES_WAITING` requests held here
(waiting for a thread, reading, or read and not yet taken). While the pool is full the worker
claims no batch rows (a claim that brought more image rows than there is room for keeps the
rest in `held`, in claim order, until room frees: at most one claim's rows); an online request
that finds it full gets a 503 at once.

Cancel and stop: `cancel(row)` drops a request (its batch cancelled or expired, its client gone)
and ends its fetch under way at once (the socket it waits on is shut); `close` does so for all
and lets the threads end. A request dropped here is never handed back: each row still ends
exactly once (a batch row's lease goes back to the queue with the worker's others).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from batchmlx.core.records import ClaimedRequest
from batchmlx.formats.request import MediaPart, ParsedRequest
from batchmlx.worker.fetch import Cancel, Cancelled
from batchmlx.worker.media import MediaReader, MediaRefused
from batchmlx.worker.online import OnlineQueue

log = logging.getLogger("batchmlx.worker")

FETCH_THREADS = 4  # media reads at a time (each under its own deadline, worker/fetch.py)
MAX_FETCHES_WAITING = 64  # requests held by the pool: waiting, reading, read and not yet taken
THREAD_NAME = "batchmlx-media"


@dataclass(eq=False, slots=True)
class MediaJob:
    """One request whose media are read; `outcome` once they are (or why they are not)."""

    claimed: ClaimedRequest
    parsed: ParsedRequest
    reader: MediaReader
    cancel: Cancel = field(default_factory=Cancel)
    outcome: tuple[MediaPart, ...] | MediaRefused | Exception | None = None

    @property
    def row(self) -> int:
        return self.claimed.id


class MediaPool:
    """A few fetch threads, the requests they read for, and those read and not yet taken.
    `submit`, `take_done` and `cancel` are the engine thread's; the loop reads the counts and
    calls `close` (a stop may come while a round still runs), so the tables change under a
    lock; the fetch threads touch only `_queue` and `_done`."""

    def __init__(
        self, threads: int = FETCH_THREADS, max_waiting: int = MAX_FETCHES_WAITING
    ) -> None:
        self.threads = threads
        self.max_waiting = max_waiting
        self.on_done: Callable[[], None] | None = None  # on a fetch thread: a read ended
        self._jobs: dict[int, MediaJob] = {}  # row -> job submitted (not yet taken)
        self._held: deque[MediaJob] = deque()  # batch rows past the bound, in claim order
        self._queue: queue.Queue[MediaJob | None] = queue.Queue()
        self._done: deque[MediaJob] = deque()  # appended by fetch threads
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False  # a stop: what is submitted now is dropped (its lease goes back)

    def __len__(self) -> int:
        """Requests held here (submitted or held back)."""
        return len(self._jobs) + len(self._held)

    def __contains__(self, row: int) -> bool:
        return row in self._jobs or any(j.row == row for j in self._held)

    @property
    def full(self) -> bool:
        return len(self._jobs) >= self.max_waiting

    @property
    def has_done(self) -> bool:
        """A read ended: the next engine round has requests to take."""
        return bool(self._done)

    def batch_rows(self) -> int:
        """Claimed batch rows held here (they count against the claim's room)."""
        return sum(1 for job in self.jobs() if not OnlineQueue.owns(job.row))

    def jobs(self) -> Iterator[MediaJob]:
        with self._lock:
            jobs = [*self._jobs.values(), *self._held]
        yield from jobs

    def submit(self, claimed: ClaimedRequest, parsed: ParsedRequest, reader: MediaReader) -> bool:
        """Read the request's media on a fetch thread; False: the pool is full (an online
        request; a batch row past the bound is held back instead)."""
        job = MediaJob(claimed, parsed, reader)
        with self._lock:
            if self._closed:
                return True  # never read, never answered: the worker stops
            if self.full:
                if OnlineQueue.owns(job.row):
                    return False
                self._held.append(job)
                return True
            self._start(job)
        return True

    def take_done(self) -> list[MediaJob]:
        """The requests whose reads ended (cancelled ones left out), in the order they ended;
        rows held back take their places."""
        out = []
        with self._lock:
            while self._done:
                job = self._done.popleft()
                if self._jobs.get(job.row) is job:
                    del self._jobs[job.row]
                    out.append(job)
            self._promote()
        return out

    def cancel(self, row: int) -> bool:
        """Drop the request and end its read under way; False: it is not here."""
        with self._lock:
            job = self._jobs.pop(row, None)
            if job is None:
                job = next((j for j in self._held if j.row == row), None)
                if job is None:
                    return False
                self._held.remove(job)
            self._promote()  # a freed slot goes to a row held back, or it would wait forever
        job.cancel.cancel()
        return True

    def open(self) -> None:
        """Take requests again after a `close` (a worker run again): a fresh queue, so a
        thread of the last run still in a name lookup cannot take this run's stop marker."""
        with self._lock:
            self._closed = False
            self._queue = queue.Queue()

    def close(self, timeout_s: float = 2.0) -> None:
        """Drop every request, end the reads under way and let the threads end (waiting at most
        `timeout_s` for them: a read's socket is shut, so they end at once). From any thread;
        it blocks up to `timeout_s` (the worker runs it off its loop)."""
        with self._lock:
            self._closed = True
            jobs = [*self._jobs.values(), *self._held]
            self._jobs.clear()
            self._held.clear()
            workers, self._workers = self._workers, []
        for job in jobs:
            job.cancel.cancel()
        for _ in workers:
            self._queue.put(None)
        for t in workers:
            t.join(timeout_s)
            if t.is_alive():  # a name lookup the resolver has not answered yet
                log.warning("a media fetch thread is still waiting; it ends with its lookup")
        self._done.clear()

    def _promote(self) -> None:
        """Under the lock: rows held back take the slots free now."""
        while self._held and not self.full and not self._closed:
            self._start(self._held.popleft())

    def _start(self, job: MediaJob) -> None:
        """Under the lock."""
        self._jobs[job.row] = job
        self._workers = [t for t in self._workers if t.is_alive()]
        if len(self._workers) < self.threads:
            t = threading.Thread(target=self._serve, args=(self._queue,),
                                 name=THREAD_NAME, daemon=True)  # fmt: skip
            t.start()
            self._workers.append(t)
        self._queue.put(job)

    def _serve(self, jobs: queue.Queue[MediaJob | None]) -> None:
        while (job := jobs.get()) is not None:
            if job.cancel.cancelled:
                continue
            try:
                job.outcome = job.reader.resolve(job.parsed.media, job.cancel)
            except Cancelled:
                continue  # dropped meanwhile: nobody takes it
            except MediaRefused as refused:
                job.outcome = refused
            except Exception as exc:  # a bug: this request's 500, never the worker's end
                log.error("reading the media of request %s failed", job.row, exc_info=exc)
                job.outcome = exc
            if job.cancel.cancelled:
                continue
            self._done.append(job)
            on_done = self.on_done
            if on_done is not None:
                on_done()
