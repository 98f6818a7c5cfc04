"""A worker's options: what it serves and how much it holds (the CLI and the server set them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchmlx.core.engine_api import ENGINE_DEFAULTS, EngineSettings


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    until_idle: bool = False  # exit once nothing is left to do
    model: str | None = None  # serve only batches of this model (None: whatever comes first)
    dtype: str = "auto"
    engine: EngineSettings = ENGINE_DEFAULTS
    claim_factor: int = 4  # hold up to this many times max_batch_size requests
    flush_s: float = 0.5  # results wait at most this long before their transaction
    max_attempts: int = 3  # claims of one request before it is given up (error file)
    # claim only batches of these models (resolved names as batches record them; "default"
    # covers batches naming none): workers on several hosts may each serve their own models
    only_models: tuple[str, ...] = ()
    progress_every_s: float = 30.0  # a running batch's progress line in the log, this often

    def taking_online(self) -> WorkerOptions:
        """These options for a worker that also takes online requests (the server's): its
        engine bounds batch prefill at every step (EngineSettings.serves_online)."""
        return replace(self, engine=replace(self.engine, serves_online=True))
