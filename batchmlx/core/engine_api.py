"""The seam between the worker and an engine: what the worker calls, and the engine's settings.

The MLX engine (engine/core.py: one loop over a model runner) is one implementation; tests
hand the worker a pure-Python fake. Each default is written here once: the CLI's options and
the scheduler read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchmlx.core.request import GenerationOutput, GenerationRequest
from batchmlx.core.telemetry import EngineCounters

TokenCallback = Callable[[str, int], None]  # (request id, token id), for every emitted token


@dataclass(frozen=True, slots=True)
class EngineSettings:
    simple: bool = False  # one request at a time
    max_batch_size: int = 256  # running sequences at most (the hard cap)
    adaptive_width: bool = True  # size the running batch of queued work (core/width.py)
    block_size: int = 16  # tokens per KV block
    max_prefill_tokens: int = 2048  # token budget of one step (prompt chunks + decodes)
    use_paged_cache: bool = True  # share prefix blocks between requests and keep them cached
    memory_aware: bool = True  # bound the KV cache by memory (else by cache_max_blocks)
    cache_memory_mb: int | None = None  # explicit bound on KV memory
    cache_memory_percent: float = 0.20  # of available memory, when no explicit bound
    cache_max_blocks: int = 4096  # the bound when memory_aware is off (an entry count)
    prefix_grouping: bool = True  # shared prefix blocks computed once per step group
    kv_grow_blocks: int = 64  # KV storage grows this many blocks at a time, up to the bound
    # running decodes and prompt chunks share a step (packed, padding-free), so decodes never
    # wait for a prefill; off: a step is all prefill or all decode (padded batch)
    mixed_steps: bool = True
    # while online requests run, a step feeds at most this many batch prompt tokens (online
    # prompts and every decode are not counted), so a step carrying an online decode stays near
    # a decode step's time rather than a full prefill's (issue 49); 0: no batch prefill then
    batch_prefill_beside_online: int = 256
    # the engine takes online requests (serve's): one can arrive during any step and waits for
    # it to end, so the bound above holds at every step, online work or not (0 there: whole
    # steps while none runs), and with none it counts the step's decodes (a step's time follows
    # its rows). Traced under a 256-chat batch: the first online requests waited 1.1-1.4 s for
    # a step of 2,016 batch prompt tokens begun before they came, then 270-440 ms for 252 batch
    # prompt tokens beside 24-60 decodes (issue 49; docs/engine.md: what 128 trades)
    serves_online: bool = False
    # and at most this many batch decodes (the earliest admitted; the rest keep their KV and
    # wait): a step's time grows with its rows, so online tokens come at the pace of a narrow
    # decode step rather than of the batch's whole running width (core/decode_turns.py). 32:
    # the width batch admissions stop at beside online work (core/width.py); measured against
    # 16 and no bound in benchmarks/online_ab.py (docs/http-api.md): 16 cut the batch's rate
    # beside the streams by half again for an inter-token tail within the noise of 32's
    batch_decodes_beside_online: int = 32
    # both bounds above hold this long after the last online request ended, as while it ran:
    # an online client's next request usually comes within moments, and would otherwise wait
    # for a step of the whole running batch and its prompts (core/online_window.py)
    online_linger_s: float = 1.0
    # beside online work a step carries no more batch prompt tokens than keep it within this
    # many times a step of its decodes alone, measured as it runs (core/prefill_pace.py): 256
    # tokens took 230-650 ms beside decode steps of 100-180 on a shared 2-core CPU; 0: the
    # token bound alone
    online_step_ratio: float = 2.0
    # queued batch work rises one priority level per this many seconds waited, in the claim
    # order and the engine's waiting queue, so no batch starves (core/priority.py); 0: strict
    priority_aging_s: float = 60.0
    # decodes keep their keys and values contiguous from step to step (engine/kv/decode.py)
    # rather than gathering them from the paged pool every step
    dense_decode: bool = True
    # a prefix every sequence of a step shares is attended once for all (cascade attention);
    # off: gathered with each sequence's keys, so a request's bits do not depend on whether
    # its neighbours share its prompt (batch invariance, docs/engine.md), at a cost there
    cascade_attention: bool = True
    # compute threads (BLAS, host kernels); None: the CPUs this process may use that other
    # processes leave free, looked at again between steps (engine/host/threads.py; `doctor`)
    threads: int | None = None

    @property
    def running_bound(self) -> int:
        """Sequences that run at once."""
        return 1 if self.simple else self.max_batch_size


ENGINE_DEFAULTS = EngineSettings()  # read defaults here (slots: the class holds no values)


class StepError(Exception):
    """A step failed; `request_ids` are the requests it ran (abort them: the rest go on)."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class EngineTelemetry(Protocol):
    """What worker/metrics reads of an engine once per step."""

    def counters(self) -> EngineCounters:
        """Cumulative counters and current gauges (core/telemetry)."""
        ...


class EngineProtocol(EngineTelemetry, Protocol):
    """What the worker needs of an engine (no probing for optional members). `add` raises
    ValueError for a request it cannot hold; `step` raises StepError naming the requests a
    failed step ran. Calls are synchronous; the worker makes them all from one object
    (worker/inflight.py), the seam where the engine's own thread goes (issue 21)."""

    on_token: TokenCallback | None

    @property
    def max_context_tokens(self) -> int:
        """Prompt plus generated tokens one sequence may reach."""
        ...

    @property
    def running_limit(self) -> int:
        """The running width batch work is admitted up to now (the worker claims by it)."""
        ...

    def add(self, req: GenerationRequest) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[GenerationOutput]:
        """Run one scheduling step; the requests that finished in it."""
        ...

    def has_unfinished(self) -> bool: ...

    def generated_so_far(self, request_id: str) -> int:
        """Tokens a running request has generated (0 once done or unknown)."""
        ...


def run_to_completion(
    engine: EngineProtocol, requests: Sequence[GenerationRequest]
) -> list[GenerationOutput]:
    """Add `requests` and step `engine` until nothing is left; outputs in request order. Every
    engine's `generate` (tests, benchmarks, scripts)."""
    for r in requests:
        engine.add(r)
    outs: dict[str, GenerationOutput] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    return [outs[r.request_id] for r in requests]


class EmbedderProtocol(Protocol):
    """What the worker needs to answer /v1/embeddings: one batched pass over token lists (no
    generation loop). The MLX engine offers one per model (engine/embed.py); an engine without
    one (a test fake) answers embeddings requests with a 500."""

    @property
    def dimensions(self) -> int:
        """Components of one (unshortened) embedding."""
        ...

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[Any]:
        """One unit-length vector (a 1-D numpy array) per input, in input order."""
        ...

    def slices(self, inputs: Sequence[Sequence[int]]) -> Iterator[list[tuple[int, Any]]]:
        """The work of `embed` in bounded slices, one forward pass per `next`, each giving the
        (input index, vector) pairs it finished: the worker steps generation between them."""
        ...
