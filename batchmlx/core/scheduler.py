"""Continuous batching over the block pool: schedule() -> step, run it, update(step, outputs).

The runner never touches scheduler state: it reads a SchedulerStep (which tokens of which
sequence, at which positions, into which blocks) and answers with sampled tokens and the ids it
decided are finished. A fake runner therefore drives this module in unit tests on any CPU.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

from batchmlx.core.blocks import Block, BlockPool
from batchmlx.core.request import CacheOutcome, FinishReason, GenerationRequest
from batchmlx.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_size: int = 32  # running sequences at most
    block_size: int = 16
    num_blocks: int = 1024  # pool size incl. the reserved block 0
    max_prefill_tokens: int = 2048  # token budget of one prefill step (a longer prompt is chunked)
    enable_prefix_cache: bool = True
    prefix_grouping: bool = True  # shared prefix blocks computed once per step group

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.block_size < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch_size, block_size and max_prefill_tokens must be positive")
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")


class StepKind(enum.Enum):
    PREFILL = "prefill"  # prompt chunks, new admissions, recomputation after preemption
    DECODE = "decode"  # one freshly sampled token per running sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # = seq.num_computed_tokens before the step: position of the first new token
    num_new_tokens: int  # tokens fed this step (prompt chunk, or 1 for decode)
    samples: bool  # this step produces a new token for it (last prompt chunk, or decode)

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


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens_computed: int = 0  # tokens fed in prefill steps (prompts and recomputation)
    prefill_tokens_reused: int = 0  # tokens taken from the prefix cache at every (re)admission
    decode_tokens: int = 0
    preemptions: int = 0
    deferred: int = 0  # admissions put off by prefix grouping (a group counts once per step)
    peak_blocks_in_use: int = 0
    peak_running: int = 0
    hits: int = 0  # first admissions by cache outcome
    misses: int = 0
    prefix_hits: int = 0


class _Admission(enum.Enum):
    DEFERRED = "deferred"  # its next block is being computed by another sequence: next step
    BLOCKED = "blocked"  # the pool cannot hold it now: stop admitting


class _WaitingQueue:
    """Waiting sequences in admission order.

    Preempted sequences come first (the earliest admitted first). New arrivals follow by
    priority (online requests before batch work), and within a priority in groups keyed by
    their first full block, so requests sharing a system prompt sit together; groups keep the
    FIFO order of their first member, and members keep FIFO order within a group.
    """

    def __init__(self, block_size: int, grouping: bool) -> None:
        self._block_size = block_size
        self._grouping = grouping
        self._front: list[Sequence] = []
        # priority -> group key -> members (dicts as ordered sets)
        self._groups: dict[int, dict[object, dict[Sequence, None]]] = {}

    def __len__(self) -> int:
        return len(self._front) + sum(
            len(g) for groups in self._groups.values() for g in groups.values()
        )

    def __bool__(self) -> bool:
        return bool(self._front or self._groups)

    def _key(self, seq: Sequence) -> object:
        if self._grouping and seq.num_prompt_tokens >= self._block_size:
            return tuple(seq.token_ids[: self._block_size])
        return seq  # a group of its own

    def push(self, seq: Sequence) -> None:
        groups = self._groups.setdefault(seq.request.priority, {})
        groups.setdefault(self._key(seq), {})[seq] = None

    def push_front(self, seq: Sequence) -> None:
        self._front.insert(0, seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self._front:
            self._front.remove(seq)
            return
        prio = seq.request.priority
        key = self._key(seq)
        group = self._groups[prio][key]
        del group[seq]
        if not group:
            del self._groups[prio][key]
            if not self._groups[prio]:
                del self._groups[prio]

    def groups(self) -> Iterator[list[Sequence] | dict[Sequence, None]]:
        """Groups in admission order; do not mutate the queue while iterating.

        Per priority, most urgent first: its preempted sequences, then its groups."""
        prios = sorted({s.request.priority for s in self._front} | set(self._groups))
        for prio in prios:
            for seq in self._front:
                if seq.request.priority == prio:
                    yield [seq]
            yield from self._groups.get(prio, {}).values()

    def count_new(self, priority: int) -> int:
        """New (never preempted) sequences waiting at `priority`."""
        return sum(len(g) for g in self._groups.get(priority, {}).values())

    def most_urgent_priority(self) -> int | None:
        return min(self._groups) if self._groups else None

    def __iter__(self) -> Iterator[Sequence]:
        for group in self.groups():
            yield from group


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool | None = None) -> None:
        if pool is None:
            pool = BlockPool(config.num_blocks, config.block_size)
        elif pool.block_size != config.block_size:
            raise ValueError("pool.block_size differs from config.block_size")
        self.config = config
        self.pool = pool
        self.stats = SchedulerStats()
        self.running: list[Sequence] = []  # admission order; preemption takes from the tail
        self.waiting = _WaitingQueue(config.block_size, config.prefix_grouping)
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._arrivals = 0

    # -- public API -------------------------------------------------------------------------

    def add(self, request: GenerationRequest) -> Sequence:
        if request.request_id in self._seqs:
            raise ValueError(f"request {request.request_id} is already in the scheduler")
        seq = Sequence(request, arrival=self._arrivals)
        self._arrivals += 1
        self._seqs[seq.seq_id] = seq
        self.waiting.push(seq)
        return seq

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def schedule(self) -> SchedulerStep | None:
        """The next step, or None when nothing is left to do.

        Algorithm: there is no separate phase state. Each sequence has num_computed_tokens
        catching up with len(token_ids). While any running sequence is still catching up on the
        tokens it knew at admission, or a waiting one can be admitted, the step is a PREFILL: it
        continues chunked prompts first, then admits waiting sequences (preempted first, then
        prefix groups in FIFO order) while fewer than max_batch_size run and the token budget
        lasts. A prefill step never preempts to admit; it only preempts to continue a running
        prompt. Otherwise the step is a DECODE: one token per running sequence, preempting the
        most recently admitted sequence when the pool is exhausted. Prefix-cache hits set
        num_computed_tokens forward at admission; blocks enter the cache in update(), after
        the step that computed them.
        """
        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        kind = StepKind.PREFILL
        seqs = self._schedule_prefill(preempted, finished)
        if not seqs:
            kind = StepKind.DECODE
            seqs = self._schedule_decode(preempted, finished)
        if not (seqs or preempted or finished):
            return None
        self._count_step(kind, seqs)
        return SchedulerStep(kind, seqs, preempted, finished)

    def update(
        self, step: SchedulerStep, sampled: dict[str, int], finished: Collection[str]
    ) -> list[Sequence]:
        """Record a step's outcome; returns the sequences that finished (their blocks freed).

        Each sampled token is appended to its sequence (the stop token too: the engine decides
        what the output shows); num_computed_tokens advances by the tokens fed; blocks that
        became full are registered in the prefix cache.
        """
        for sched in step.seqs:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.num_computed_tokens != sched.start:
                raise RuntimeError(f"update() out of order for {seq.seq_id}")
            seq.num_computed_tokens += sched.num_new_tokens
            if self.config.enable_prefix_cache:
                self._register_full_blocks(seq)
            if sched.samples:
                token = sampled.get(seq.seq_id)
                if token is not None:
                    seq.token_ids.append(token)
                elif seq.seq_id not in finished:
                    raise ValueError(f"no token sampled for {seq.seq_id}")
        done: list[Sequence] = []
        for seq_id in finished:
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted, or already ended by the scheduler
            self.running.remove(seq)
            self._finish(seq, None)
            done.append(seq)
        return done

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq, None)
        return seq

    # -- prefill ----------------------------------------------------------------------------

    def _schedule_prefill(
        self, preempted: list[Sequence], finished: list[Sequence]
    ) -> list[ScheduledSeq]:
        budget = self.config.max_prefill_tokens
        out: list[ScheduledSeq] = []
        # Hashes of full blocks some running sequence is computing: a waiting sequence whose
        # next block is among them waits one step and then hits the cache instead.
        pending: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not seq.is_prefilling:
                continue
            if budget == 0:
                break
            n = min(seq.prefill_end - seq.num_computed_tokens, budget)
            n = self._reserve(seq, n, preempted, finished)
            if n == 0:
                continue
            out.append(self._scheduled(seq, n))
            budget -= n
            pending.update(self._inflight_hashes(seq))
        if budget > 0 and not preempted:  # memory is short: do not admit what was just evicted
            preempted.extend(self._make_room_for_urgent(out))
            self._admit_waiting(out, budget, pending, finished)
        return out

    def _make_room_for_urgent(self, scheduled: list[ScheduledSeq]) -> list[Sequence]:
        """Online work outranks batch work: with the running batch full, each waiting urgent
        sequence takes the slot of the most recently admitted less urgent one, which is
        recomputed later with the same output."""
        urgent = self.waiting.most_urgent_priority()
        if urgent is None:
            return []
        busy = {s.seq for s in scheduled}  # already fed this step: keep
        wanted = self.waiting.count_new(urgent)
        victims: list[Sequence] = []
        while wanted > 0 and len(self.running) >= self.config.max_batch_size:
            victim = next(
                (s for s in reversed(self.running)
                 if s.request.priority > urgent and s not in busy),
                None,
            )  # fmt: skip
            if victim is None:
                break
            self._preempt(victim)
            victims.append(victim)
            wanted -= 1
        return victims

    def _admit_waiting(
        self, out: list[ScheduledSeq], budget: int, pending: set[int], finished: list[Sequence]
    ) -> None:
        admitted: list[Sequence] = []
        blocked = False
        for group in self.waiting.groups():
            if blocked or budget == 0 or len(self.running) >= self.config.max_batch_size:
                break
            if self._group_deferred(group, pending):
                self.stats.deferred += 1
                continue
            for seq in group:
                if budget == 0 or len(self.running) >= self.config.max_batch_size:
                    break
                result = self._admit(seq, budget, pending)
                if result is _Admission.DEFERRED:
                    self.stats.deferred += 1
                    continue
                if result is _Admission.BLOCKED:
                    if not self.running:  # alone in the pool and still too big: never fits
                        admitted.append(seq)
                        self._finish(seq, FinishReason.LENGTH)
                        finished.append(seq)
                    blocked = True  # FIFO: nothing overtakes a sequence waiting for memory
                    break
                assert isinstance(result, ScheduledSeq)
                out.append(result)
                admitted.append(seq)
                self.running.append(seq)
                budget -= result.num_new_tokens
        for seq in admitted:
            self.waiting.remove(seq)

    def _group_deferred(self, group: Collection[Sequence], pending: set[int]) -> bool:
        """Skip a whole group at once while its shared first block is being computed."""
        if not pending or not self.config.enable_prefix_cache or len(group) < 2:
            return False
        first = next(iter(group))
        bs = self.config.block_size
        if (first.num_prompt_tokens - 1) // bs < 1:
            return False
        h0 = self._hashes(first, 1)[0]
        return h0 in pending and self.pool.lookup(h0, first.block_tokens(0, bs)) is None

    def _admit(self, seq: Sequence, budget: int, pending: set[int]) -> ScheduledSeq | _Admission:
        """Admit seq with a first chunk of at most `budget` tokens, reusing cached blocks."""
        bs = self.config.block_size
        hits: list[Block] = []
        max_hit = (seq.num_tokens - 1) // bs  # the last token must be computed for its logits
        if self.config.enable_prefix_cache and max_hit > 0:
            hashes = self._hashes(seq, max_hit)
            for i in range(max_hit):
                block = self.pool.lookup(hashes[i], seq.block_tokens(i, bs))
                if block is None:
                    break
                hits.append(block)
            if self.config.prefix_grouping and len(hits) < max_hit and hashes[len(hits)] in pending:
                return _Admission.DEFERRED
        start = len(hits) * bs
        n = min(seq.num_tokens - start, budget)
        available = self.pool.num_free - sum(1 for b in hits if b.ref_count == 0)
        if -(-n // bs) > available:
            if self.running:
                return _Admission.BLOCKED
            n = min(n, available * bs)  # alone in the pool: a smaller chunk rather than never
            if n == 0:
                return _Admission.BLOCKED
        for block in hits:
            self.pool.touch(block)
        new = self.pool.allocate_many(-(-n // bs))
        assert new is not None  # checked against num_free above
        seq.block_table = [b.block_id for b in hits] + [b.block_id for b in new]
        seq.num_computed_tokens = start
        seq.num_registered_blocks = len(hits)
        seq.prefill_end = seq.num_tokens
        seq.status = SequenceStatus.RUNNING
        self.stats.prefill_tokens_reused += start
        if seq.cache_outcome is None:
            self._record_outcome(seq, start, max_hit)
        if self.config.prefix_grouping:
            pending.update(self._inflight_hashes(seq))
        return self._scheduled(seq, n)

    def _record_outcome(self, seq: Sequence, cached: int, max_hit: int) -> None:
        seq.num_cached_tokens = cached
        if cached == 0:
            seq.cache_outcome = CacheOutcome.MISS
            self.stats.misses += 1
        elif cached == max_hit * self.config.block_size:
            seq.cache_outcome = CacheOutcome.HIT
            self.stats.hits += 1
        else:
            seq.cache_outcome = CacheOutcome.PREFIX_HIT
            self.stats.prefix_hits += 1

    # -- decode -----------------------------------------------------------------------------

    def _schedule_decode(
        self, preempted: list[Sequence], finished: list[Sequence]
    ) -> list[ScheduledSeq]:
        out: list[ScheduledSeq] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_uncomputed_tokens != 1:
                raise RuntimeError(f"{seq.seq_id} is not decoding: prefill should have run")
            if self._reserve(seq, 1, preempted, finished):
                out.append(self._scheduled(seq, 1))
        return out

    # -- blocks -----------------------------------------------------------------------------

    def _reserve(
        self, seq: Sequence, n: int, preempted: list[Sequence], finished: list[Sequence]
    ) -> int:
        """Blocks for n more tokens of a running seq; returns the tokens it may feed (0: none).

        When the pool is exhausted the most recently admitted sequence is preempted, seq itself
        if it is the most recent. A sequence left alone that still cannot grow never will: it
        takes a smaller chunk if any room is left, else it ends with LENGTH (the pool is its
        context), rather than being preempted and recomputed into the same wall forever.
        """
        bs = self.config.block_size
        while True:
            need = -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_table)
            if need <= 0:
                return n
            new = self.pool.allocate_many(need)
            if new is not None:
                seq.block_table.extend(b.block_id for b in new)
                return n
            victim = self.running[-1]
            if victim is not seq:
                self._preempt(victim)
                preempted.append(victim)
                continue
            if len(self.running) > 1:
                self._preempt(seq)
                preempted.append(seq)
                return 0
            room = len(seq.block_table) * bs - seq.num_computed_tokens + self.pool.num_free * bs
            if room > 0:
                n = min(n, room)
                continue
            self.running.remove(seq)
            self._finish(seq, FinishReason.LENGTH)
            finished.append(seq)
            return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)  # full cached blocks stay in the prefix cache, evictable
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.prefill_end = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.push_front(seq)

    def _finish(self, seq: Sequence, reason: FinishReason | None) -> None:
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.cache_outcome is None:  # ended before its first admission
            seq.cache_outcome = CacheOutcome.MISS
        del self._seqs[seq.seq_id]

    def _release(self, seq: Sequence) -> None:
        # Reverse order: the tail of a sequence is evicted before its head.
        self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table))
        seq.block_table = []

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.config.block_size
        full = seq.num_computed_tokens // bs
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            block = self.pool.blocks[seq.block_table[i]]
            self.pool.cache_block(block, hashes[i], seq.block_tokens(i, bs))
        seq.num_registered_blocks = full

    def _hashes(self, seq: Sequence, n: int) -> list[int]:
        """seq.block_hashes extended to at least n full blocks (hashes depend on tokens only)."""
        bs = self.config.block_size
        hashes = seq.block_hashes
        while len(hashes) < n:
            parent = hashes[-1] if hashes else None
            hashes.append(self.pool.hash_fn(parent, seq.block_tokens(len(hashes), bs)))
        return hashes

    def _inflight_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks seq will compute before it samples: its uncached prompt."""
        if not (self.config.enable_prefix_cache and self.config.prefix_grouping):
            return []
        bs = self.config.block_size
        first, end = seq.num_computed_tokens // bs, seq.prefill_end // bs
        return self._hashes(seq, end)[first:end] if end > first else []

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, n, samples=start + n == seq.num_tokens)

    def _count_step(self, kind: StepKind, seqs: list[ScheduledSeq]) -> None:
        stats = self.stats
        stats.steps += 1
        fed = sum(s.num_new_tokens for s in seqs)
        if kind is StepKind.PREFILL:
            stats.prefill_steps += 1
            stats.prefill_tokens_computed += fed
        else:
            stats.decode_steps += 1
            stats.decode_tokens += fed
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.pool.num_used)
        stats.peak_running = max(stats.peak_running, len(self.running))
