"""The decode rows' keys and values kept contiguous from step to step: a dense copy of the pool.

A packed step's decodes each attend to their sequence's whole KV. Gathered from the paged pool,
that is every key of every running sequence copied once per layer per step (~1 ms a layer at
width 64 over ~150 keys; a fifth of the step), although the step before gathered the same keys
but one. `DecodeKV` keeps them instead, per layer, as [S, H, L, D]: S slots (one per decoding
sequence), L keys of room. A step writes one new row per sequence into it; the pool stays the
source of truth (prefix cache, preemption, prompt chunks) and is written as before.

A slot is filled from the pool when its sequence joins (first decode, or back after a step
without it), taking a slot that a finished sequence left; the whole copy is rebuilt from the
pool, as one gather (the cost of one step's gather before), when the keys outgrow L, when
there is no free slot for a joiner, or when a quarter of the slots are free (they would cost
attention work). A copy that would be mostly room (one long sequence among short ones) is not
made: those steps gather. Behind a prefix every decode shares (cascade attention), the copy
holds the keys after it, and the prefix's own keys are gathered once and kept while the same
blocks are shared: complete blocks are never written again. Its memory is bounded
(`budget_bytes`, at most BUDGET_BYTES) and so is its width (MAX_SLOTS): past either, steps
gather as before. Host steps whose paged decode kernel runs (engine/host/paged_attention.py:
decode rows read the pool through their block tables) keep no copy; it serves MLX's path and
CPUs without AVX-512.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from batchmlx.engine.kv.paged import (
    PackedLayout,
    PagedKVStorage,
    SegmentKind,
    additive_bias,
    gather_prefix,
    key_room,
)

# L grows in steps of this many blocks (a rebuild every 32 steps at block size 16): more room
# is attention work over masked keys at every step, less is more rebuilds
GROWTH_BLOCKS = 2
# rebuilt (compacted) once this fraction of the slots is free
MAX_FREE_FRACTION = 0.25
# no copy of slots x room past this many times the keys the rows hold: one long sequence among
# short ones would make every slot as long as it (a 1,000-token prompt joining 24 short decodes:
# 25 x 1,024 keys for ~4,800 held, 1.2 GB taken fresh, a 2 s step); such steps gather instead,
# whose copies are per layer and reused
MAX_PADDING = 2.0
# The copy is made for at most this many decodes, in at most BUDGET_BYTES. Measured at 135M
# (bf16 host GEMMs, 256 unique prompts, 32 new tokens, 2026-12-01): the copy gains 20% at
# width 32 (200.7 vs 167.2 tok/s) and nothing past 64 (width 128: 287 vs 290; width 256: 281
# vs 311), where it held 0.5-1.1 GB; unbounded, a long-running server's memory followed its
# width (issue 21). Wider steps gather, whose copies are one layer's and transient. Host
# steps (engine/host/step.py) gain more from it, their gathers being a tenth of a step at
# width 64: 64 unique prompts x 128 tokens in 16.6-17.5 s within 256 MiB (no copy once the
# keys pass ~90), 15.0-15.7 s within 1 GiB (the copy peaking at ~565 MB), on one thread of a
# shared machine (2026-12-02); hence 768 MiB. And wider: at width 128 host decode steps take
# 151.7 ms with the copy against 186.0 ms gathering (medians of 3, quiet, 2026-12-02).
MAX_SLOTS = 128
BUDGET_BYTES = 768 << 20


@dataclass(slots=True)
class DecodePlan:
    """What one step does with the dense copy; every index is a row of the [S*H*L, D] arrays."""

    owner: DecodeKV
    slots: int  # S
    capacity: int  # L
    rebuild_runs: mx.array | None  # [S, H, L / block_size] pool runs of a rebuild, else None
    join_rows: mx.array | None  # [n] rows of the copy filled from the pool (joiners)...
    join_src: mx.array | None  # ... from these pool rows
    write_rows: mx.array  # [R*H] row of each decode's new key, per head
    slot_rows: mx.array | None  # [S] the segment row whose query each slot takes; None: slot i
    row_slots: mx.array | None  # [R] the slot of each segment row; None: row i
    mask: mx.array  # [S, 1, 1, L] bool, True = attend
    bias: mx.array  # the mask as 0 / -inf
    # [H, P / block_size] pool runs of a prefix all the rows share, to gather this step (it
    # is then kept while the same blocks are shared: they are complete, never written again)
    prefix_runs: mx.array | None = None
    # [S] position of each slot's query (a free slot: 0), host-side: the host step's
    # sliding-window layers limit the mask with it (key j of a slot is at position j)
    positions: np.ndarray | None = None

    def fetch(
        self, layer: int, kpool: mx.array, vpool: mx.array, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None]:
        """This layer's dense keys and values [S, H, L, D] with the step's new rows in, and the
        shared prefix's [H, P, D] (or None). kpool, vpool: the layer's pool with the step
        already written; keys, values: the segment's new rows [R, H, 1, D]."""
        kv = self.owner
        d = kpool.shape[-1]
        run = kv.block_size * d
        out = []
        for pool, new, layers in ((kpool, keys, kv.keys), (vpool, values, kv.values)):
            if self.rebuild_runs is not None:  # already holds the step's new rows
                arr = layers[layer] = pool.reshape(-1, run)[self.rebuild_runs].reshape(-1, d)
            else:
                # written in place (MLX donates the buffer: a step costs its new rows only)
                arr = layers[layer]
                if self.join_rows is not None:
                    arr[self.join_rows] = pool[self.join_src]
                arr[self.write_rows] = new.reshape(-1, d).astype(arr.dtype)
            out.append(arr.reshape(self.slots, kv.n_kv_heads, self.capacity, d).astype(new.dtype))
        if self.prefix_runs is not None:
            kruns, vruns = kpool.reshape(-1, run), vpool.reshape(-1, run)
            kv.prefix[layer] = gather_prefix(kruns, vruns, self.prefix_runs, kv.n_kv_heads, d,
                                             keys.dtype)  # fmt: skip
        return out[0], out[1], kv.prefix[layer] if kv.prefix_blocks else None


class DecodeKV:
    """The dense copy of the decoding sequences' KV (see the module docstring)."""

    def __init__(self, storage: PagedKVStorage, budget_bytes: int, key_group: int = 1) -> None:
        self.block_size = storage.block_size
        # the room is a multiple of this many keys (the host steps: kv/paged.KEY_GROUP)
        self.key_group = key_group
        self.n_kv_heads = storage.n_kv_heads
        self.num_layers = storage.num_layers
        # bytes per key slot: keys and values of every layer
        self._slot_bytes = (
            2 * storage.num_layers * storage.n_kv_heads * storage.head_dim * (storage.dtype.size)
        )
        self.budget_bytes = budget_bytes
        self.keys: list[mx.array | None] = []  # per layer [S*H*L, D]
        self.values: list[mx.array | None] = []
        # a prefix every slot shares (cascade attention reads it once for all): its block ids,
        # and per layer its keys and values [H, P, D]
        self.prefix_blocks: tuple[int, ...] = ()
        self.prefix: list[tuple[mx.array, mx.array] | None] = []
        self.slots: list[str | None] = []  # the sequence in each slot
        self.held: list[int] = []  # keys each slot holds
        self.capacity = 0
        # how the copy was kept (tests and benchmarks read them): whole rebuilds, sequences
        # filled into a free slot, sequences refilled in their own slot after missing steps
        self.rebuilds = self.joins = self.refills = 0
        self.prefix_gathers = 0  # shared prefixes gathered (then kept while shared)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def arrays(self) -> list[mx.array]:
        """The copy's arrays (evaluated with the step, so no graph outlives it)."""
        prefix = [a for kv in self.prefix if kv is not None for a in kv]
        return [a for a in (*self.keys, *self.values) if a is not None] + prefix

    def reset(self) -> None:
        """Forget the copy (its memory goes with it); the next decode step rebuilds."""
        self.keys, self.values, self.slots, self.held = [], [], [], []
        self.prefix_blocks, self.prefix = (), []
        self.capacity = 0

    def attach(
        self, layout: PackedLayout, seq_ids: list[str], token_chunks: list[list[int]],
        starts: list[int], block_tables: list[list[int]], prompts: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """Point the layout's decode segment at the dense copy, planned for this step, or drop
        the copy when the step has no segment that may use it. The other arguments: the step's
        sequences as the layout was built from them (prompts: PackedLayout.build's)."""
        seg = layout.segments[0] if layout.segments else None
        if seg is None or seg.kind is not SegmentKind.ROWS:
            self.reset()
            return
        # the segment's rows, in its order
        rows = [i for i, c in enumerate(token_chunks) if len(c) == 1 and i not in prompts]
        # a shared prefix (cascade) is read once for all rows: the copy holds the keys after it
        shared = 0 if seg.prefix_runs is None else int(seg.prefix_runs.shape[1])
        seg.dense = self.plan(
            [seq_ids[i] for i in rows],
            [starts[i] - shared * self.block_size for i in rows],
            [block_tables[i][shared:] for i in rows],
            prefix=tuple(block_tables[rows[0]][:shared]),
        )

    def plan(
        self,
        seq_ids: list[str],
        positions: list[int],
        tables: list[list[int]],
        prefix: tuple[int, ...] = (),
    ) -> DecodePlan | None:
        """The step's plan for decode rows (sequence, position of its new token, block table),
        in segment order; None (the step gathers) when a rebuilt copy would not fit the
        budget, would be wider than MAX_SLOTS or would be mostly padding (MAX_PADDING).
        prefix: block ids every row shares ahead of the positions and tables given (attended
        once for all, kept apart)."""
        if prefix != self.prefix_blocks:
            self.reset()  # the keys after a prefix start elsewhere: every slot is refilled
        need = max(positions) + 1
        where = {sid: s for s, sid in enumerate(self.slots) if sid is not None}
        stepping = set(seq_ids)
        for s, sid in enumerate(self.slots):
            if sid is not None and sid not in stepping:
                self.slots[s] = None  # finished, preempted or left out: its slot is free
        new = [i for i, sid in enumerate(seq_ids) if sid not in where]
        free = [s for s, sid in enumerate(self.slots) if sid is None]
        rebuild = (
            self.capacity == 0
            or need > self.capacity
            or len(new) > len(free)
            or (len(free) - len(new)) > MAX_FREE_FRACTION * len(self.slots)
        )
        join_rows = join_src = rebuild_runs = None
        if rebuild:
            rebuilt = self._rebuild(seq_ids, positions, tables, prefix)
            if rebuilt is None:
                return None
            slot_of_row, rebuild_runs = rebuilt
        else:
            slot_of_row, join_rows, join_src = self._join(seq_ids, positions, tables, where)
        return self._plan(slot_of_row, positions, prefix, rebuild_runs, join_rows, join_src)

    def _rebuild(
        self, seq_ids: list[str], positions: list[int], tables: list[list[int]],
        prefix: tuple[int, ...],
    ) -> tuple[np.ndarray, mx.array] | None:  # fmt: skip
        """A whole new copy, row i in slot i: (slot of each row, the pool runs it is gathered
        from); None when it would not fit the budget or would be mostly padding."""
        bs, h = self.block_size, self.n_kv_heads
        need = max(positions) + 1
        cap = key_room(need, GROWTH_BLOCKS * bs, self.key_group)
        held = sum(positions) + len(positions)
        too_big = (len(seq_ids) * cap + len(prefix) * bs) * self._slot_bytes > self.budget_bytes
        if too_big or len(seq_ids) > MAX_SLOTS or len(seq_ids) * need > MAX_PADDING * held:
            # this step gathers; the copy is kept as it is (its slots refill or it is
            # rebuilt later): dropped, its buffers would sit in MLX's cache, useless to the
            # gathers (measured: 1.2 GB taken fresh every such step)
            return None
        old = self.nbytes
        grew = 0 < old < (len(seq_ids) * cap + len(prefix) * bs) * self._slot_bytes
        self.reset()
        if grew:
            # the old copy's buffers back to the allocator now: the new copy is larger, so
            # MLX's buffer cache could never reuse them, and held there they made every such
            # rebuild hold two copies at once (a same-size rebuild reuses them instead)
            mx.clear_cache()
        self.rebuilds += 1
        self.keys = [None] * self.num_layers  # filled layer by layer by the step
        self.values = [None] * self.num_layers
        self.capacity = cap
        self.slots = list(seq_ids)
        self.held = [p + 1 for p in positions]
        nkb = cap // bs
        table = np.zeros((len(seq_ids), nkb), dtype=np.int64)  # block 0: scratch, masked
        for r, t in enumerate(tables):
            used = min(len(t), nkb)
            table[r, :used] = t[:used]
        runs = table[:, None, :] * h + np.arange(h)[None, :, None]
        return np.arange(len(seq_ids)), mx.array(runs.astype(np.int32))

    def _join(
        self, seq_ids: list[str], positions: list[int], tables: list[list[int]],
        where: dict[str, int],
    ) -> tuple[np.ndarray, mx.array | None, mx.array | None]:  # fmt: skip
        """The copy kept: (slot of each row, rows of the copy filled from the pool, the pool
        rows they come from). New sequences (a sequence left out of a step lost its slot)
        take a free slot; one whose copy lags its position (steps that gathered kept the copy
        as it was) refills its own. `where`: the slot of each sequence the copy held."""
        bs, h = self.block_size, self.n_kv_heads
        stale = [i for i, sid in enumerate(seq_ids)
                 if sid in where and self.held[where[sid]] != positions[i]]  # fmt: skip
        new = [i for i, sid in enumerate(seq_ids) if sid not in where]
        free = [s for s, sid in enumerate(self.slots) if sid is None]
        slot_of_row = np.array([where.get(sid, 0) for sid in seq_ids], dtype=np.int64)
        for i, s in zip(new, free, strict=False):
            slot_of_row[i] = s
            self.slots[s] = seq_ids[i]
        self.joins += len(new)
        self.refills += len(stale)
        dst, src = [], []
        for i in [*stale, *new]:
            s = int(slot_of_row[i])
            n = positions[i]  # keys before this step's: copied from the pool
            if n:
                pos = np.arange(n)
                blk = np.asarray(tables[i], dtype=np.int64)[pos // bs]
                heads = np.arange(h)[:, None]
                src.append(((blk[None, :] * h + heads) * bs + (pos % bs)[None, :]).ravel())
                dst.append(((s * h + heads) * self.capacity + pos[None, :]).ravel())
        for i in range(len(seq_ids)):
            self.held[slot_of_row[i]] = positions[i] + 1
        join_rows = mx.array(np.concatenate(dst).astype(np.int32)) if dst else None
        join_src = mx.array(np.concatenate(src).astype(np.int32)) if src else None
        return slot_of_row, join_rows, join_src

    def _plan(
        self, slot_of_row: np.ndarray, positions: list[int], prefix: tuple[int, ...],
        rebuild_runs: mx.array | None, join_rows: mx.array | None, join_src: mx.array | None,
    ) -> DecodePlan:  # fmt: skip
        """The plan over the slots as placed: new-row writes, slot <-> row maps, mask, and the
        shared prefix to gather when the copy does not hold it yet."""
        h = self.n_kv_heads
        slots, n_rows = len(self.slots), len(positions)
        pos = np.asarray(positions, dtype=np.int64)
        write = (slot_of_row[:, None] * h + np.arange(h)[None, :]) * self.capacity + pos[:, None]
        identity = slots == n_rows and bool((slot_of_row == np.arange(slots)).all())
        row_of_slot = np.zeros(slots, dtype=np.int64)  # a free slot attends as row 0 (dropped)
        row_of_slot[slot_of_row] = np.arange(n_rows)
        lengths = np.zeros(slots, dtype=np.int64)
        lengths[slot_of_row] = pos + 1
        mask = np.arange(self.capacity)[None, :] < lengths[:, None]
        mask[:, 0] = True  # a free slot sees key 0, so its (dropped) softmax stays finite
        m = mx.array(mask[:, None, None, :])
        prefix_runs = None
        if prefix and not self.prefix_blocks:  # gathered this step, kept for the next ones
            self.prefix_blocks = prefix
            self.prefix_gathers += 1
            self.prefix = [None] * self.num_layers
            blocks = np.asarray(prefix, dtype=np.int64)
            prefix_runs = mx.array((blocks[None, :] * h + np.arange(h)[:, None]).astype(np.int32))
        return DecodePlan(
            owner=self,
            slots=slots,
            capacity=self.capacity,
            rebuild_runs=rebuild_runs,
            join_rows=join_rows,
            join_src=join_src,
            write_rows=mx.array(write.reshape(-1).astype(np.int32)),
            slot_rows=None if identity else mx.array(row_of_slot.astype(np.int32)),
            row_slots=None if identity else mx.array(slot_of_row.astype(np.int32)),
            mask=m,
            bias=additive_bias(m),
            prefix_runs=prefix_runs,
            positions=lengths - 1 if not prefix else None,
        )
