"""Continuous batching over the block pool: schedule() -> step, run it, update(step, outputs).

The runner never touches scheduler state: it reads a SchedulerStep (which tokens of which
sequence, at which positions, into which blocks) and answers with sampled tokens and the ids it
decided are finished. A fake runner therefore drives this module in unit tests on any CPU.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection

from batchmlx.core.blocks import BlockPool
from batchmlx.core.decode_turns import DecodeTurns, is_urgent
from batchmlx.core.kv_manager import KVCacheManager, blocks_for
from batchmlx.core.online_window import OnlineWindow
from batchmlx.core.prefill_pace import PrefillPace
from batchmlx.core.priority import engine_aging
from batchmlx.core.request import BATCH_PRIORITY, CacheOutcome, GenerationRequest
from batchmlx.core.schedule import (
    ScheduledSeq,
    SchedulerConfig,
    SchedulerStats,
    SchedulerStep,
    StepKind,
    chunk_length,
    step_kind,
)
from batchmlx.core.sequence import Sequence, SequenceStatus
from batchmlx.core.waiting import WaitingQueue

# the step's types live in core/schedule.py; importers keep naming them from here
__all__ = ["ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerStats", "SchedulerStep",
           "StepKind"]  # fmt: skip


class _Admission(enum.Enum):
    DEFERRED = "deferred"  # its next block is being computed by another sequence: next step
    BLOCKED = "blocked"  # the pool cannot hold it now: stop admitting
    LATER = "later"  # no aligned chunk of it fits the step's budget left: stop admitting


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if pool is None:
            pool = BlockPool(config.num_blocks, config.block_size)
        elif pool.block_size != config.block_size:
            raise ValueError("pool.block_size differs from config.block_size")
        self.config = config
        self.pool = pool  # counters (blocks in use, cached, free) for stats and dashboards
        tile = config.chunk_align if config.chunk_align > 1 else 0  # see KVCacheManager.tile
        self.kv = KVCacheManager(pool, enable_prefix_cache=config.enable_prefix_cache, tile=tile)
        self.stats = SchedulerStats()
        self.running: list[Sequence] = []  # admission order; preemption takes from the tail
        aging = engine_aging(config.priority_aging_s) if config.priority_aging_s else None
        self.waiting = WaitingQueue(config.block_size, config.prefix_grouping, aging, clock)
        self._seqs: dict[str, Sequence] = {}  # every unfinished sequence
        self._arrivals = 0
        # Batch work (priority >= BATCH_PRIORITY) is admitted only while fewer than this run
        # (the "max_batch_size" of schedule()'s docstring, for batch work); the engine's width
        # controller moves it (core/width.py). More urgent work is admitted up to
        # max_batch_size, the hard cap, whatever this is.
        self.running_limit = config.max_batch_size
        self._window = OnlineWindow(config.online_linger_s, clock)
        self._pace = PrefillPace(config.online_step_ratio, config.batch_prefill_beside_online)
        self._clock = clock
        self._scheduled_at = 0.0  # when the step being run was scheduled (its time: update())
        self._online_now = False  # online work runs or waits at this step
        self._beside_online = False  # this step keeps the bounds it takes beside online work

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
        catching up with len(token_ids): a running sequence below its prefill_end (the tokens
        it knew at admission) is prefilling, one token behind is decoding. Prefix-cache hits
        set num_computed_tokens forward at admission; blocks enter the cache in update(),
        after the step that computed them.

        Mixed steps (the default, vLLM v1's way): one pass over the running sequences in
        admission order gives every decoding sequence its token (they never wait for a
        prompt) and continues chunked prompts with the token budget the decodes leave; then
        waiting sequences are admitted (preempted first, then prefix groups in FIFO order)
        while fewer than max_batch_size run and the budget lasts. When the pool is exhausted
        the most recently admitted sequence is preempted; a step that preempted for memory
        admits nobody, so what was just evicted is not taken back at once (no preemption
        storm).

        Unmixed steps: a step is a PREFILL (the pass above over prompts only, then admission)
        while any prompt work can run, else a DECODE of every running sequence.
        """
        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        paused = self.stats.paused_decodes
        self._scheduled_at = self._clock()
        urgent = self.waiting.most_urgent_priority()
        self._online_now = (urgent is not None and urgent < BATCH_PRIORITY) or bool(
            self.online_running()
        )
        self._beside_online = self._window.step(self._online_now)
        if self.config.mixed_steps:
            seqs = self._schedule_mixed(preempted, finished)
        else:
            seqs = self._schedule_prefill(preempted, finished)
            if not seqs:
                seqs = self._schedule_decode(preempted, finished)
        if not (seqs or preempted or finished):
            return None
        kind = step_kind(seqs)
        self._count_step(kind, seqs)
        return SchedulerStep(kind, seqs, preempted, finished, self.stats.paused_decodes - paused,
                             self._beside_online)  # fmt: skip

    def update(
        self, step: SchedulerStep, sampled: dict[str, int], finished: Collection[str]
    ) -> list[Sequence]:
        """Record a step's outcome; returns the sequences that finished (their blocks freed).

        Each sampled token is appended to its sequence (the stop token too: the engine decides
        what the output shows); num_computed_tokens advances by the tokens fed; blocks that
        became full are registered in the prefix cache.
        """
        if step.beside_online:  # the step's time, from schedule() to here (core/prefill_pace.py)
            prompt = sum(s.num_new_tokens for s in step.seqs if not s.decode)
            self._pace.observe(prompt, self._clock() - self._scheduled_at)
        for sched in step.seqs:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            if seq.num_computed_tokens != sched.start:
                raise RuntimeError(f"update() out of order for {seq.seq_id}")
            seq.num_computed_tokens += sched.num_new_tokens
            self.kv.register_full_blocks(seq)
            if sched.samples:
                token = sampled.get(seq.seq_id)
                if token is not None:
                    seq.token_ids.append(token)
                elif seq.seq_id not in finished:
                    raise ValueError(f"no token sampled for {seq.seq_id}")
        done: list[Sequence] = []
        for seq_id in finished:
            ended = self._seqs.get(seq_id)
            if ended is None or ended.status is not SequenceStatus.RUNNING:
                continue  # aborted, or already ended by the scheduler
            self.running.remove(ended)
            self._finish(ended)
            done.append(ended)
        return done

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._finish(seq)
        return seq

    # -- mixed ------------------------------------------------------------------------------

    def _schedule_mixed(
        self, preempted: list[Sequence], finished: list[Sequence]
    ) -> list[ScheduledSeq]:
        # urgent online work takes its slots before anything is scheduled (nothing is busy yet)
        victims = self._make_room_for_urgent([])
        turns = self._decode_turns()
        decodes = turns.decodes(s for s in self.running if not s.is_prefilling)
        budget = max(self.config.max_prefill_tokens - decodes, 0)  # left for prompt tokens
        batch = self._batch_budget(budget, decodes)  # of which batch prompts may take
        out: list[ScheduledSeq] = []
        pending: set[int] = set()  # see _schedule_prefill
        # admission order, so a victim (the tail) is never one already scheduled this step
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not seq.is_prefilling:
                self._check_decoding(seq)
                if turns.takes(seq) and self._reserve(seq, 1, preempted, finished):
                    out.append(self._scheduled(seq, 1, decode=True))
                continue
            allowed = budget if _urgent(seq) else min(budget, batch)
            if allowed > 0:
                n = self._continue_prompt(seq, allowed, out, pending, preempted, finished)
                budget -= n
                batch -= 0 if _urgent(seq) else n
        if budget > 0 and not preempted:  # memory is short: do not admit what was just evicted
            self._admit_waiting(out, budget, pending, finished, batch)
        preempted[:0] = victims
        self.stats.paused_decodes += turns.paused
        return out

    def _batch_budget(self, budget: int, decodes: int = 0) -> int:
        """Prompt tokens batch work may take this step (`decodes`: the rows it feeds besides):
        the step's budget, or beside online work (core/online_window.py), at most
        `batch_prefill_beside_online` of it and what keeps the step within `online_step_ratio`
        decode steps (core/prefill_pace.py). An engine that serves online requests keeps a
        bound at every step: a running step is not interrupted, so one arriving during a
        whole-budget batch prefill would wait for all of it (seconds on a CPU). There the bound
        counts the step's decodes too (a step's time follows its rows, whichever kind): with
        no online work, batch prompts fill a step up to `batch_prefill_beside_online` rows, at
        least a floor's worth. Traced under a 256-chat batch, 2 s in: 48-60 decodes beside
        252 batch prompt tokens, 270-440 ms, and the first online request waited for it."""
        cap = self.config.batch_prefill_beside_online
        if self._online_now:
            return min(budget, self._pace.tokens())
        if cap == 0:  # 0 stops batch prompts only while online work is there: else none could run
            return budget
        if self._beside_online:
            return min(budget, self._pace.tokens())
        if not self.config.serves_online:
            return budget
        return min(budget, max(cap - decodes, min(cap, self._pace.floor)))

    # -- prefill ----------------------------------------------------------------------------

    def _schedule_prefill(
        self, preempted: list[Sequence], finished: list[Sequence]
    ) -> list[ScheduledSeq]:
        budget = self.config.max_prefill_tokens
        batch = self._batch_budget(budget)
        out: list[ScheduledSeq] = []
        # Hashes of full blocks some running sequence is computing: a waiting sequence whose
        # next block is among them waits one step and then hits the cache instead.
        pending: set[int] = set()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or not seq.is_prefilling:
                continue
            if budget == 0:
                break
            allowed = budget if _urgent(seq) else min(budget, batch)
            if allowed > 0:
                n = self._continue_prompt(seq, allowed, out, pending, preempted, finished)
                budget -= n
                batch -= 0 if _urgent(seq) else n
        if budget > 0 and not preempted:  # memory is short: do not admit what was just evicted
            preempted.extend(self._make_room_for_urgent(out))
            self._admit_waiting(out, budget, pending, finished, batch)
        return out

    def _continue_prompt(
        self,
        seq: Sequence,
        budget: int,
        out: list[ScheduledSeq],
        pending: set[int],
        preempted: list[Sequence],
        finished: list[Sequence],
    ) -> int:
        """Schedule the next chunk (at most `budget` tokens) of a running sequence's prompt;
        the tokens scheduled (0 when the pool cannot hold any)."""
        start = seq.num_computed_tokens
        n = chunk_length(start, seq.prefill_end - start, budget, self.config.chunk_align,
                         _no_prompt_yet(out))  # fmt: skip
        if n == 0:
            return 0
        n = self._reserve(seq, n, preempted, finished)
        if n:
            out.append(self._scheduled(seq, n))
            pending.update(self._inflight_hashes(seq))
        return n

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
            self.stats.urgent_preemptions += 1
            victims.append(victim)
            wanted -= 1
        return victims

    def _admission_limit(self, seq: Sequence) -> int:
        if seq.request.priority < BATCH_PRIORITY:
            return self.config.max_batch_size
        limit = min(self.running_limit, self.config.max_batch_size)
        if self._beside_online:  # a batch sequence admitted past its decode turns would wait
            limit = min(limit, self.online_running() + self.config.batch_decodes_beside_online)
        return limit

    def _decode_turns(self) -> DecodeTurns:
        """This step's batch decodes (core/decode_turns.py)."""
        limit = self.config.batch_decodes_beside_online
        return DecodeTurns(limit if self._beside_online else None)

    def online_running(self) -> int:
        """Running sequences more urgent than batch work."""
        return sum(1 for s in self.running if s.request.priority < BATCH_PRIORITY)

    def _admit_waiting(
        self,
        out: list[ScheduledSeq],
        budget: int,
        pending: set[int],
        finished: list[Sequence],
        batch: int | None = None,
    ) -> None:
        """Admit waiting sequences, most urgent first, in at most `budget` prompt tokens, of
        which batch work takes at most `batch` (None: all of them)."""
        batch = budget if batch is None else batch
        admitted: list[Sequence] = []
        blocked = False
        for group in self.waiting.groups():
            # groups come most urgent first: once one is at its limit, so are the rest
            first = next(iter(group))
            limit = self._admission_limit(first)
            room = budget if _urgent(first) else min(budget, batch)
            if blocked or room <= 0 or len(self.running) >= limit:
                break
            if self._group_deferred(group, pending):
                self.stats.deferred += 1
                continue
            for seq in group:
                room = budget if _urgent(seq) else min(budget, batch)
                if room <= 0 or len(self.running) >= limit:
                    break
                result = self._admit(seq, room, pending, _no_prompt_yet(out))
                if result is _Admission.LATER:
                    blocked = True
                    break
                if result is _Admission.DEFERRED:
                    self.stats.deferred += 1
                    continue
                if result is _Admission.BLOCKED:
                    if not self.running:  # alone in the pool and still too big: never fits
                        admitted.append(seq)
                        self._finish(seq)  # the engine reports it with LENGTH
                        finished.append(seq)
                    blocked = True  # FIFO: nothing overtakes a sequence waiting for memory
                    break
                assert isinstance(result, ScheduledSeq)
                out.append(result)
                admitted.append(seq)
                self.running.append(seq)
                budget -= result.num_new_tokens
                batch -= 0 if _urgent(seq) else result.num_new_tokens
        for seq in admitted:
            self.waiting.remove(seq)

    def _group_deferred(self, group: Collection[Sequence], pending: set[int]) -> bool:
        """Skip a whole group at once while its shared first block is being computed."""
        if not pending or not self.config.enable_prefix_cache or len(group) < 2:
            return False
        first = next(iter(group))
        if (first.num_prompt_tokens - 1) // self.config.block_size < 1:
            return False
        return self.kv.hashes(first, 1)[0] in pending and self.kv.lookup(first, 0) is None

    def _admit(
        self, seq: Sequence, budget: int, pending: set[int], first: bool
    ) -> ScheduledSeq | _Admission:
        """Admit seq with a first chunk of at most `budget` tokens, reusing cached blocks
        (first: no prompt chunk is in the step yet, see `chunk_length`). A preempted sequence
        whose hits reach past its prompt, with replay_decodes, starts with a decode row."""
        bs = self.config.block_size
        max_hit = self.kv.max_cached_blocks(seq, bs)
        hits = self.kv.cached_prefix(seq)
        if (
            self.config.enable_prefix_cache
            and self.config.prefix_grouping
            and len(hits) < max_hit
            and self.kv.hashes(seq, max_hit)[len(hits)] in pending
        ):
            return _Admission.DEFERRED
        start = len(hits) * bs
        # prompt work ends at its prompt when its generated tokens are replayed as decodes
        end = max(start, seq.num_prompt_tokens) if self.config.replay_decodes else seq.num_tokens
        n = 1
        if start < end:
            n = chunk_length(start, end - start, budget, self.config.chunk_align, first)
            if n == 0:
                return _Admission.LATER
        available = self.kv.free_after(hits)
        if blocks_for(n, bs) > available:
            if self.running:
                return _Admission.BLOCKED
            n = min(n, available * bs)  # alone in the pool: a smaller chunk rather than never
            if n == 0:
                return _Admission.BLOCKED
        taken = self.kv.admit(seq, hits, n)
        assert taken  # checked against the free blocks above
        seq.num_computed_tokens = start
        seq.prefill_end = end
        seq.status = SequenceStatus.RUNNING
        self.stats.prefill_tokens_reused += start
        if seq.cache_outcome is None:
            self._record_outcome(seq, start, max_hit)
        if self.config.prefix_grouping:
            pending.update(self._inflight_hashes(seq))
        return self._scheduled(seq, n, decode=start >= end)

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
        turns = self._decode_turns()
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            self._check_decoding(seq)
            if turns.takes(seq) and self._reserve(seq, 1, preempted, finished):
                out.append(self._scheduled(seq, 1, decode=True))
        self.stats.paused_decodes += turns.paused
        return out

    def _check_decoding(self, seq: Sequence) -> None:
        """A running sequence past its prompt work has one token to feed: the one sampled last
        step, or with replay_decodes any number (generated before a preemption)."""
        n = seq.num_uncomputed_tokens
        if n != 1 and not (self.config.replay_decodes and n > 1):
            raise RuntimeError(f"{seq.seq_id} is not decoding: prefill should have run")

    # -- growth and eviction ---------------------------------------------------------------

    def _reserve(
        self, seq: Sequence, n: int, preempted: list[Sequence], finished: list[Sequence]
    ) -> int:
        """Blocks for n more tokens of a running seq; returns the tokens it may feed (0: none).

        When the pool is exhausted the most recently admitted sequence is preempted, seq itself
        if it is the most recent. A sequence left alone that still cannot grow never will: it
        takes a smaller chunk if any room is left, else it ends with LENGTH (the pool is its
        context), rather than being preempted and recomputed into the same wall forever.
        """
        while True:
            if self.kv.reserve(seq, n):
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
            room = self.kv.room(seq)
            if room > 0:
                n = min(n, room)
                continue
            self.running.remove(seq)
            self._finish(seq)  # the engine reports it with LENGTH
            finished.append(seq)
            return 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)  # full cached blocks stay in the prefix cache, evictable
        seq.num_computed_tokens = 0
        seq.prefill_end = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.push_front(seq)

    def _finish(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        if seq.cache_outcome is None:  # ended before its first admission
            seq.cache_outcome = CacheOutcome.MISS
        del self._seqs[seq.seq_id]

    def _inflight_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full blocks seq will compute before it samples: its uncached prompt."""
        if not (self.config.enable_prefix_cache and self.config.prefix_grouping):
            return []
        bs = self.config.block_size
        first, end = seq.num_computed_tokens // bs, seq.prefill_end // bs
        return self.kv.hashes(seq, end)[first:end] if end > first else []

    def _scheduled(self, seq: Sequence, n: int, *, decode: bool = False) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, n, samples=start + n == seq.num_tokens, decode=decode)

    def _count_step(self, kind: StepKind, seqs: list[ScheduledSeq]) -> None:
        stats = self.stats
        stats.steps += 1
        if kind is StepKind.PREFILL:
            stats.prefill_steps += 1
        elif kind is StepKind.DECODE:
            stats.decode_steps += 1
        else:
            stats.mixed_steps += 1
        for s in seqs:
            if s.decode:
                stats.decode_tokens += s.num_new_tokens
                stats.replayed_tokens += not s.samples
            else:
                stats.prefill_tokens_computed += s.num_new_tokens
        stats.peak_blocks_in_use = max(stats.peak_blocks_in_use, self.pool.num_used)
        stats.peak_running = max(stats.peak_running, len(self.running))


_urgent = is_urgent


def _no_prompt_yet(out: list[ScheduledSeq]) -> bool:
    """No prompt (or recompute) chunk is among the step's sequences so far."""
    return all(s.decode for s in out)
