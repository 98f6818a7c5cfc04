"""The CPU backend's state in one object: its settings, the engine's live thread count, the
oneDNN library once loaded and the host-attention thread pool.

The worker makes one (worker/build.py, from batchmlx/config.py's HostSettings) and hands it to
what it builds: the model loader (host weight formats, the weights cache) gives it to every host
layer, the host steps take it from their model's layers (step.py), and the thread governor moves
its `threads`. The one process-wide slot is `current()`, which the composition root sets
(`install`): MLX's own attention path calls the host kernels from deep inside a model
(kernels/attention.py) with no one to pass it. Callers that install none (tests, scripts,
benchmarks) get one of the settings batchmlx/config.py reads from the environment, so the
documented variables work for them too; nothing here reads the environment itself.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from batchmlx.config import HostSettings, load_host_settings
from batchmlx.engine.host import numpy_blas, onednn
from batchmlx.engine.host.onednn import OneDNN, OneDNNUnavailable
from batchmlx.engine.host.threads import ComputeThreads

# Threads host attention splits tiles (or a decode step's sequences) over: numpy releases the
# GIL in its kernels, and the softmax passes are single-threaded otherwise. At most 2 (measured
# on 2 cores) and at most the engine's thread count when the pool starts.
ATTENTION_THREADS = max(1, min(2, os.cpu_count() or 1))
# The pool's thread names: idle between steps (a step waits for its jobs), so the CLI may end
# the process with them alive (cli.entry._exit)
THREAD_NAME = "host-attention"


class HostBackend:
    """What the host kernels share in a process (see the module doc)."""

    def __init__(
        self, settings: HostSettings | None = None, threads: ComputeThreads | None = None
    ) -> None:
        self.settings = HostSettings() if settings is None else settings
        self.threads = ComputeThreads(self.settings.threads) if threads is None else threads
        self.pool_threads = ATTENTION_THREADS  # the pool's size once it starts
        self._onednn: OneDNN | None = None
        self._attention_onednn: OneDNN | None | bool = False  # False: not looked for yet
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def onednn(self) -> OneDNN:
        """oneDNN, loaded on first use and kept; OneDNNUnavailable (with what to install)
        when it cannot be (asked again next time)."""
        with self._lock:
            if self._onednn is None:
                self._onednn = onednn.open_library(self.settings.onednn_library, self.threads)
            return self._onednn

    def onednn_available(self) -> bool:
        """oneDNN can be loaded here (and MLX runs on its CPU backend)."""
        try:
            self.onednn()
        except OneDNNUnavailable:
            return False
        return True

    def attention_onednn(self) -> OneDNN | None:
        """oneDNN for decode attention's products, when it loads here (else numpy's matmul);
        looked for once."""
        if self._attention_onednn is False:
            self._attention_onednn = self.onednn() if self.onednn_available() else None
        return self._attention_onednn  # type: ignore[return-value]

    def pool(self) -> ThreadPoolExecutor:
        """The attention tile threads, started on first use; numpy's own BLAS goes
        single-threaded first, so two tiles' matmuls do not each start a BLAS thread team on
        the same two cores (measured: a 1,000-token prefill 1.2 s -> 2.3 s)."""
        with self._lock:
            if self._pool is None:
                numpy_blas.set_threads(1)
                self.pool_threads = max(
                    1, min(ATTENTION_THREADS, self.threads.n or ATTENTION_THREADS)
                )
                self._pool = ThreadPoolExecutor(self.pool_threads, thread_name_prefix=THREAD_NAME)
            return self._pool


_current: HostBackend | None = None


def current() -> HostBackend:
    """The backend the composition root installed, else one of the environment's settings
    (config.load_host_settings)."""
    global _current
    if _current is None:
        _current = HostBackend(load_host_settings())
    return _current


def install(backend: HostBackend) -> HostBackend:
    """Make `backend` this process's (the worker's composition root calls it)."""
    global _current
    _current = backend
    return backend
