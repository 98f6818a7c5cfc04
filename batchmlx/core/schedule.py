"""What one scheduler step is: the config it runs under, the sequences it feeds and how many
tokens of each, its kind, the running counters, and where a prompt chunk may be cut."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from batchmlx.core.engine_api import ENGINE_DEFAULTS
from batchmlx.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = ENGINE_DEFAULTS.max_batch_size  # running sequences at most
    block_size: int = ENGINE_DEFAULTS.block_size
    num_blocks: int = 1024  # pool size incl. the reserved block 0
    # token budget of one step, decode tokens included when steps are mixed (a longer prompt is
    # chunked)
    max_prefill_tokens: int = ENGINE_DEFAULTS.max_prefill_tokens
    enable_prefix_cache: bool = ENGINE_DEFAULTS.use_paged_cache
    prefix_grouping: bool = ENGINE_DEFAULTS.prefix_grouping  # shared prefix blocks computed once
    # one step feeds the running decodes and prompt chunks together (else a step is all one kind)
    mixed_steps: bool = ENGINE_DEFAULTS.mixed_steps
    # batch prompt tokens of a step while online work runs or waits (EngineSettings says why)
    batch_prefill_beside_online: int = ENGINE_DEFAULTS.batch_prefill_beside_online
    # online requests may arrive at any step: the bound above holds at every step
    serves_online: bool = ENGINE_DEFAULTS.serves_online
    # batch decodes of a step while online work runs (EngineSettings says why)
    batch_decodes_beside_online: int = ENGINE_DEFAULTS.batch_decodes_beside_online
    # both bounds hold this long after online work ended (core/online_window.py)
    online_linger_s: float = ENGINE_DEFAULTS.online_linger_s
    # beside online work, batch prompt tokens keep a step within this many decode steps' time
    online_step_ratio: float = ENGINE_DEFAULTS.online_step_ratio
    # waiting batch work rises a priority level per this many seconds waited (0: strict)
    priority_aging_s: float = ENGINE_DEFAULTS.priority_aging_s
    # a prompt chunk the step's budget cuts ends at a multiple of this many positions (the host
    # steps: their attention tiles, engine/host/attention.TILE_QUERIES), so that each row
    # attends in the tile it would if the prompt ran whole (batch invariance); 1: anywhere
    chunk_align: int = 1
    # a preempted sequence resumes as it ran: its prompt as prompt chunks, its generated tokens
    # fed back one a step as decode rows (the kernels that wrote their KV the first time), not
    # in one recompute chunk (batch invariance; a step per token the prefix cache lost)
    replay_decodes: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.block_size < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch_size, block_size and max_prefill_tokens must be positive")
        if self.batch_decodes_beside_online < 1:
            raise ValueError("batch_decodes_beside_online must be positive (batch work starves)")
        if self.chunk_align < 1:
            raise ValueError("chunk_align must be positive")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")


class StepKind(enum.Enum):
    PREFILL = "prefill"  # prompt chunks, new admissions, recomputation after preemption
    DECODE = "decode"  # one freshly sampled token per running sequence
    MIXED = "mixed"  # both: the running decodes and prompt chunks in one step


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens before the step: position of the first new token
    num_new_tokens: int  # tokens fed this step (prompt chunk, or 1 for decode)
    samples: bool  # this step produces a new token for it (last prompt chunk, or decode)
    decode: bool = False  # its one token was sampled last step (else prompt or recompute work)

    @property
    def token_ids(self) -> list[int]:
        """The tokens fed this step, at positions start..start+num_new_tokens-1."""
        return self.seq.token_ids[self.start : self.start + self.num_new_tokens]


@dataclass(slots=True)
class SchedulerStep:
    kind: StepKind
    seqs: list[ScheduledSeq]
    preempted: list[Sequence]  # lost their blocks this step; will be recomputed later
    finished: list[Sequence] = field(default_factory=list)  # ended by the scheduler: LENGTH, the
    # pool cannot hold them even alone. The runner reports them like any finished sequence.
    paused: int = 0  # running batch decodes left out beside online work (core/decode_turns.py)
    beside_online: bool = False  # taken beside online work: its time is measured (prefill_pace)


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    mixed_steps: int = 0
    prefill_tokens_computed: int = 0  # prompt and recomputation tokens fed, in any step
    prefill_tokens_reused: int = 0  # tokens taken from the prefix cache at every (re)admission
    decode_tokens: int = 0  # sampled tokens fed back, in any step
    replayed_tokens: int = 0  # of which fed back after a preemption (replay_decodes), unsampled
    preemptions: int = 0
    urgent_preemptions: int = 0  # of which to make room for more urgent (online) work
    paused_decodes: int = 0  # batch decodes left out of a step beside online work (they wait)
    deferred: int = 0  # admissions put off by prefix grouping (a group counts once per step)
    peak_blocks_in_use: int = 0
    peak_running: int = 0
    hits: int = 0  # first admissions by cache outcome
    misses: int = 0
    prefix_hits: int = 0


def step_kind(seqs: list[ScheduledSeq]) -> StepKind:
    decodes = sum(s.decode for s in seqs)
    if decodes == len(seqs):  # a step of decodes only (or of nothing but scheduler finishes)
        return StepKind.DECODE
    return StepKind.PREFILL if decodes == 0 else StepKind.MIXED


def chunk_length(start: int, wanted: int, budget: int, align: int, first: bool) -> int:
    """Tokens of a prompt chunk from position `start`: all `wanted` when the `budget` holds
    them, else up to the last multiple of `align` the budget reaches; 0 when it reaches none,
    unless `first` (no prompt chunk yet this step: a step budget shorter than `align`, left by
    the decodes or beside online work, still moves the first prompt on, wherever it ends)."""
    if wanted <= budget:
        return wanted
    end = (start + budget) // align * align
    if end > start:
        return end - start
    return budget if first else 0
