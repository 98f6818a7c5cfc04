"""One sequence in the scheduler: a GenerationRequest plus its tokens, blocks and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchmlx.core.request import CacheOutcome, GenerationRequest


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted: holds no blocks
    RUNNING = "running"  # holds blocks; is fed tokens step by step
    FINISHED = "finished"  # finished or aborted: holds no blocks


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's state in the engine. Identity equality: it is a key in the scheduler's queues.

    There is no phase field: num_computed_tokens catches up with len(token_ids), which covers
    chunked prefill, prefix hits, decode and recomputation after preemption with one rule.
    """

    request: GenerationRequest
    arrival: int  # order of add(); ties broken by it
    seq_id: str = field(init=False)  # = request.request_id
    token_ids: list[int] = field(init=False)  # prompt + generated
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0  # leading tokens whose KV is in the blocks of block_table
    block_table: list[int] = field(default_factory=list)  # block ids, position p in p // block_size
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    prefill_end: int = 0  # len(token_ids) at (re)admission: below it is prompt/recompute work
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache at FIRST admission
    cache_outcome: CacheOutcome | None = None  # set at first admission, kept across preemption
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    queued_at: float = 0.0  # when it (re)entered the waiting queue (the scheduler's clock): aging

    def __post_init__(self) -> None:
        if not self.request.prompt_tokens:
            raise ValueError(f"request {self.request.request_id} has an empty prompt")
        self.seq_id = self.request.request_id
        self.token_ids = list(self.request.prompt_tokens)
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """Still catching up on tokens known at admission (prompt chunks or recomputation)."""
        return self.num_computed_tokens < self.prefill_end

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        """Tokens of block `index` (full or not)."""
        return tuple(self.token_ids[index * block_size : (index + 1) * block_size])
