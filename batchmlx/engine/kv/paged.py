"""Paged KV storage in MLX, and the per-layer cache object that plugs it into mlx-lm models.

The block pool (`core/blocks.py`) decides which block ids a sequence owns; this module stores the
keys and values at those ids. A layer's storage is one array of rows of `head_dim` floats laid out
block-major, then head, then offset in the block: row = (block * H + head) * block_size + offset.
So a (block, head) pair is one contiguous run of block_size * head_dim floats, and gathering a
sequence's blocks per head yields keys already shaped [B, H, K, D] for attention, with no
transpose copy (measured: that copy was a third of a batch-32 decode step).

mlx-lm attention calls `cache.update_and_fetch(keys, values)` after RoPE with `cache.offset`,
and builds its mask through `cache.make_mask`; a `PagedLayerCache` answers both for a whole
ragged batch (per-sequence offsets as an array, a boolean mask over the gathered keys). That seam
lets any mlx-lm architecture with the standard cache protocol run paged.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from batchmlx.core.blocks import NULL_BLOCK_ID

SCRATCH_ROW = 0  # first row of block NULL_BLOCK_ID, which the pool never hands out: padding


class PagedKVStorage:
    """Keys and values of every block, per layer, grown on demand up to `max_blocks`.

    Growing (rather than allocating the bound up front) makes `nbytes` the memory actually held,
    so sharing blocks shows up as a smaller array, not only as a smaller block count.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        n_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: mx.Dtype,
        max_blocks: int,
        grow_blocks: int = 64,
    ) -> None:
        self.num_layers = num_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.max_blocks = max_blocks
        self.grow_blocks = grow_blocks
        self.capacity_blocks = 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.peak_nbytes = 0
        self.growths = 0  # times the arrays were made larger (tests and benchmarks read it)
        self.ensure_capacity(min(grow_blocks, max_blocks))

    @staticmethod
    def bytes_per_block(
        num_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: mx.Dtype
    ) -> int:
        return 2 * num_layers * block_size * n_kv_heads * head_dim * dtype.size

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def ensure_capacity(self, num_blocks: int, forecast: int = 0) -> None:
        """Make block ids < num_blocks addressable (never past max_blocks). forecast: the ids
        the running sequences may need soon; a growth goes that far at once."""
        if num_blocks <= self.capacity_blocks:
            return
        # grown by half at least, and to the forecast: each growth copies the whole pool into
        # fresh memory, whose first touch is most of the cost (~1.5 GB/s here: 351 MB in 240
        # ms), so copies stay few however large it gets. By half only, 64 chats of up to 128
        # tokens spent 1.89 s of a 20.3 s run growing (4 times); to the forecast, 0.27 s (twice)
        grow = max(self.grow_blocks, self.capacity_blocks // 2)
        target = min(self.max_blocks, max(num_blocks, self.capacity_blocks + grow, forecast))
        extra = (target - self.capacity_blocks) * self.n_kv_heads * self.block_size
        shape = (extra, self.head_dim)
        if not self.keys:
            self.keys = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
            self.values = [mx.zeros(shape, self.dtype) for _ in range(self.num_layers)]
        else:
            # one layer at a time, the old array's memory given back before the next layer's
            # is made: at most one layer is held twice (all at once, a growth held the whole
            # pool twice, and MLX's buffer cache kept the old one's buffers, too small to reuse)
            pad = mx.zeros(shape, self.dtype)
            for arrays in (self.keys, self.values):
                for i, old in enumerate(arrays):
                    arrays[i] = mx.concatenate([old, pad])
                    mx.eval(arrays[i])
                    del old
                    mx.clear_cache()
            del pad
            mx.clear_cache()
        mx.eval(self.keys, self.values)
        self.growths += 1
        self.capacity_blocks = target
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes)


@dataclass(slots=True)
class BatchLayout:
    """Where one step's tokens go and what each of them attends to.

    B sequences, each feeding up to Q new tokens (padded), each attending to up to K keys.
    """

    tokens: mx.array  # [B, Q] int32
    offsets: mx.array  # [B] position of each sequence's first new token
    write_rows: mx.array  # [B*H*Q] storage row of each new token's KV per head (padding: scratch)
    gather_runs: mx.array  # [B, H, K / block_size] (block, head) runs each sequence attends to
    mask: mx.array  # [B, 1, Q, K] bool, True = attend
    last_index: mx.array  # [B] index in Q of each sequence's last real token
    # [H, P / block_size] runs of a prefix every sequence shares (same blocks), or None; when
    # set, gather_runs and mask cover only the keys after it (cascade attention)
    prefix_runs: mx.array | None = None
    # the mask as 0 / -inf to add to scores (one pass per step rather than a `where` per layer)
    bias: mx.array | None = None
    # query i of every sequence attends to no gathered key past causal_offset + i
    causal_offset: int | None = None
    # [B, Q] position of each query and [K] of each key, host-side: only a model with
    # sliding-window layers reads them (window_mask)
    query_pos: np.ndarray | None = None
    key_pos: np.ndarray | None = None
    _windows: dict[int, mx.array] = field(default_factory=dict)

    def window_mask(self, window: int) -> mx.array:
        """`mask` limited to the last `window` keys of each query (sliding-window layers): the
        mask mlx-lm builds for a rotating cache of that size."""
        if window not in self._windows:
            near = self.key_pos[None, None, :] > self.query_pos[:, :, None] - window
            self._windows[window] = self.mask & mx.array(near[:, None])
        return self._windows[window]

    @staticmethod
    def build(
        *,
        block_size: int,
        n_kv_heads: int,
        token_chunks: list[list[int]],
        starts: list[int],
        block_tables: list[list[int]],
        share_prefix: bool = True,
    ) -> BatchLayout:
        """Lay out a ragged step. token_chunks[i] are sequence i's new tokens at positions
        starts[i]..; block_tables[i] covers every position up to the chunk's end.
        share_prefix False: no cascade attention (its prefix part has no mask, so a model with
        sliding-window layers must not use it)."""
        b = len(token_chunks)
        lens = np.array([len(c) for c in token_chunks], dtype=np.int64)
        st = np.array(starts, dtype=np.int64)
        q = int(lens.max())

        tokens = np.zeros((b, q), dtype=np.int32)
        for i, chunk in enumerate(token_chunks):
            tokens[i, : len(chunk)] = chunk

        nblk = max(len(t) for t in block_tables)
        table = np.zeros((b, max(nblk, 1)), dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, : len(t)] = t

        h = n_kv_heads
        heads = np.arange(h)[None, :, None]
        qpos = st[:, None] + np.arange(q)[None, :]  # [B, Q]
        qvalid = np.arange(q)[None, :] < lens[:, None]
        blk = np.take_along_axis(table, np.minimum(qpos // block_size, table.shape[1] - 1), 1)
        rows = (blk[:, None, :] * h + heads) * block_size + (qpos % block_size)[:, None, :]
        write = np.where(qvalid[:, None, :], rows, SCRATCH_ROW)  # [B, H, Q]

        gather_runs, mask, prefix_runs, qwin, kpos = _key_view(
            block_size, h, table, st, lens, qpos, qvalid, share_prefix
        )
        return BatchLayout(
            tokens=mx.array(tokens),
            offsets=mx.array(st.astype(np.int32)),
            write_rows=mx.array(write.reshape(-1).astype(np.int32)),
            gather_runs=gather_runs,
            mask=mask,
            last_index=mx.array((lens - 1).astype(np.int32)),
            prefix_runs=prefix_runs,
            bias=additive_bias(mask),
            causal_offset=int(st.max()) - int(kpos[0]),
            query_pos=qwin,
            key_pos=kpos,
        )


class SegmentKind(enum.Enum):
    ROWS = "rows"  # one-token sequences (decodes) as [B, Hq, 1, D]
    CHUNK = "chunk"  # one sequence's prompt chunk as [1, Hq, L, D]
    CHUNKS = "chunks"  # chunks of similar length, padded to the longest: [B, Hq, Q, D]


# chunks share a segment while the padded queries stay within this factor of the real ones:
# one attention call for many short chunks (a batch of prompts behind a cached system prompt)
# without paying much padding, while a long chunk keeps a segment of its own
CHUNK_PADDING_BOUND = 1.5


@dataclass(slots=True)
class Segment:
    """Packed tokens [first, first + length) that attend as one batch of B sequences of up to
    Q queries each (see SegmentKind)."""

    first: int
    length: int
    kind: SegmentKind
    batch: int  # B
    queries: int  # Q
    gather_runs: mx.array  # [B, H, K / block_size]
    mask: mx.array  # [B, 1, Q, K] bool
    prefix_runs: mx.array | None  # shared prefix of the B sequences (cascade attention), or None
    bias: mx.array  # the mask as 0 / -inf
    causal_offset: int  # query i attends to no gathered key past causal_offset + i
    # CHUNKS only: row (from `first`) of each of the B*Q padded queries (padding repeats a real
    # row; the mask keeps it finite and its output is dropped), and the padded index of each
    # of the `length` real rows
    pad_rows: mx.array | None = None
    real_rows: mx.array | None = None
    # ROWS only: the step's plan for the decodes' dense KV (decode_kv.DecodePlan), or None:
    # keys and values gathered from the pool
    dense: Any = None
    # [B, Q] position of each query and [K] of each gathered key, host-side: the host step's
    # sliding-window layers limit the mask with them (engine/host/step_kv.py)
    query_pos: np.ndarray | None = None
    key_pos: np.ndarray | None = None
    # ROWS (and a host step's CHUNK), host-side: [B, blocks] each sequence's block ids (a
    # shared prefix's first), for the host's paged attention (engine/host/paged_attention.py),
    # which reads the pool through them; each query sees query_pos + 1 keys
    block_table: np.ndarray | None = None


@dataclass(slots=True)
class PackedLayout:
    """A ragged step without padding: its T tokens side by side as a batch of T rows of one
    token ([T, 1]), so every projection and MLP computes exactly T rows however the step mixes
    decodes and prompt chunks. Each token carries its own RoPE position; attention regroups the
    rows by `segments` (engine/kernels/attention.py). Tokens are ordered one-token sequences
    first, then the chunks, longest first, each chunk's tokens together; `last_index` maps each
    input sequence to the row of its last token."""

    tokens: mx.array  # [T, 1] int32
    offsets: mx.array  # [T] absolute position of each token
    write_rows: mx.array  # [T*H] storage row of each token's KV per head, token-major
    segments: list[Segment]
    last_index: mx.array  # [S] row of each sequence's last token, in input order

    @staticmethod
    def build(
        *,
        block_size: int,
        n_kv_heads: int,
        token_chunks: list[list[int]],
        starts: list[int],
        block_tables: list[list[int]],
        share_prefix: bool = True,
        host: bool = False,
        prompts: frozenset[int] = frozenset(),
    ) -> PackedLayout:
        """Lay out a step like BatchLayout.build, without padding. host (the host steps, made
        batch-invariant): each prompt chunk its own segment, never padded into a batch with
        another (its tiles, and so its bits, then depend on it alone), and each segment's keys
        padded to a multiple of KEY_GROUP. prompts: the chunks that are prompt work, laid out
        as chunks even of one token (what a prefix-cache hit may leave: as a row with the
        decodes its last token would be attended by another kernel than without the hit)."""
        h = n_kv_heads
        single = [len(c) == 1 and not (host and i in prompts) for i, c in enumerate(token_chunks)]
        singles = [i for i, one in enumerate(single) if one]
        chunks = [i for i, one in enumerate(single) if not one]
        tokens: list[int] = []
        positions: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        last = np.zeros(len(token_chunks), dtype=np.int32)
        segments: list[Segment] = []

        def place(i: int) -> None:
            pos = starts[i] + np.arange(len(token_chunks[i]))
            table = np.asarray(block_tables[i], dtype=np.int64)
            blk = table[pos // block_size]
            offset = (pos % block_size)[:, None]
            rows.append((blk[:, None] * h + np.arange(h)) * block_size + offset)  # [L, H]
            positions.append(pos)
            last[i] = len(tokens) + len(pos) - 1
            tokens.extend(token_chunks[i])

        def segment(members: list[int], kind: SegmentKind) -> None:
            first = len(tokens)
            for i in members:
                place(i)
            lens = np.array([len(token_chunks[i]) for i in members], dtype=np.int64)
            st = np.array([starts[i] for i in members], dtype=np.int64)
            b, q = len(members), int(lens.max())
            nblk = max(max(len(block_tables[i]) for i in members), 1)
            table = np.zeros((b, nblk), dtype=np.int64)
            for r, i in enumerate(members):
                table[r, : len(block_tables[i])] = block_tables[i]
            qpos = st[:, None] + np.arange(q)[None, :]
            qvalid = np.arange(q)[None, :] < lens[:, None]
            runs, mask, prefix, qwin, kpos = _key_view(
                block_size, h, table, st, lens, qpos, qvalid, share_prefix, KEY_GROUP if host else 1
            )
            seg = Segment(
                first,
                len(tokens) - first,
                kind,
                b,
                q,
                runs,
                mask,
                prefix,
                additive_bias(mask),
                int(st.max()) - int(kpos[0]),
                query_pos=qwin,
                key_pos=kpos,
            )
            if kind is SegmentKind.ROWS or (host and kind is SegmentKind.CHUNK):
                seg.block_table = table
            if kind is SegmentKind.CHUNKS:
                member_first = np.concatenate([[0], np.cumsum(lens)[:-1]])
                pad = member_first[:, None] + np.arange(q)[None, :]
                seg.pad_rows = mx.array(np.where(qvalid, pad, 0).reshape(-1).astype(np.int32))
                real = (np.arange(b)[:, None] * q + np.arange(q)[None, :])[qvalid]
                seg.real_rows = mx.array(real.astype(np.int32))
            segments.append(seg)

        if singles:
            segment(singles, SegmentKind.ROWS)
        lens = [len(token_chunks[i]) for i in chunks]
        groups = (_chunk_groups(lens) if not host
                  else [[j] for j in sorted(range(len(lens)), key=lambda j: -lens[j])])  # fmt: skip
        for group in groups:
            members = [chunks[j] for j in group]
            segment(members, SegmentKind.CHUNK if len(members) == 1 else SegmentKind.CHUNKS)
        return PackedLayout(
            tokens=mx.array(np.asarray(tokens, dtype=np.int32)[:, None]),
            offsets=mx.array(np.concatenate(positions).astype(np.int32)),
            write_rows=mx.array(np.concatenate(rows).reshape(-1).astype(np.int32)),
            segments=segments,
            last_index=mx.array(last),
        )


# A shared prefix shorter than this many blocks is gathered with each sequence's own keys rather
# than attended once for all (cascade): a chat template's short default system prompt (2 blocks
# behind 7 of each sequence's own) only added the cascade's merge to every layer (width-64
# decode steps 128 -> 120 ms without it), while a 900-token system prompt is read once.
MIN_CASCADE_BLOCKS = 8
# A step's keys are padded (masked) to a multiple of this many, and the host's decode attention
# scores them this many at a time: each score GEMM call then has the same shape whatever the
# batch's longest sequence, so a row's scores and sums do not depend on its neighbours (numpy's
# BLAS picks its kernel by shape: a 3 x 64 by 64 x L product gave other bits at L = 160 than at
# L = 700, measured 2026-12-06; engine/host/attention.py)
KEY_GROUP = 32


def key_room(keys: int, block_size: int, group: int | None = None) -> int:
    """`keys` rounded up to whole blocks and to a multiple of `group` (KEY_GROUP)."""
    step = math.lcm(block_size, KEY_GROUP if group is None else group)
    return -(-keys // step) * step


def _chunk_groups(lens: list[int]) -> list[list[int]]:
    """Indices into lens, grouped: longest first, a chunk joins the current group while the
    group padded to its longest stays within CHUNK_PADDING_BOUND of its real tokens."""
    groups: list[list[int]] = []
    real = 0
    for j in sorted(range(len(lens)), key=lambda j: -lens[j]):
        if groups:
            g = groups[-1]
            if (len(g) + 1) * lens[g[0]] <= CHUNK_PADDING_BOUND * (real + lens[j]):
                g.append(j)
                real += lens[j]
                continue
        groups.append([j])
        real = lens[j]
    return groups


def _key_view(
    block_size: int,
    h: int,
    table: np.ndarray,
    st: np.ndarray,
    lens: np.ndarray,
    qpos: np.ndarray,
    qvalid: np.ndarray,
    share_prefix: bool = True,
    key_group: int = 1,
) -> tuple[mx.array, mx.array, mx.array | None, np.ndarray, np.ndarray]:
    """The keys a batch of sequences attends to: (gather runs [B, H, K / block_size], mask
    [B, 1, Q, K], shared prefix runs or None, query positions [B, Q] and key positions [K] for
    window masks). table [B, blocks]: each sequence's block ids; st, lens [B]: first position
    and count of its new tokens; qpos, qvalid [B, Q]. share_prefix False: no cascade attention
    (its prefix part has no mask, so a model with sliding-window layers must not use it).
    key_group: the keys padded (masked) to a multiple of it (the host steps: KEY_GROUP)."""
    b = table.shape[0]
    ends = st + lens  # keys each sequence sees after this step's writes
    k = int(ends.max())
    # keys are gathered whole blocks at a time (16x fewer indices than per token); the
    # tail of the last block is masked out
    k = key_room(k, block_size, key_group)
    nkb = k // block_size
    gather = table[:, :nkb]  # entries past a sequence's own blocks are 0: scratch, masked
    if gather.shape[1] < nkb:
        gather = np.pad(gather, ((0, 0), (0, nkb - gather.shape[1])))
    heads = np.arange(h)[None, :, None]
    shared = _shared_prefix_blocks(gather, lens, int(st.min()) // block_size)
    if not share_prefix or shared < MIN_CASCADE_BLOCKS:
        shared = 0
    prefix_runs = None
    if shared:
        # the shared blocks are read once for the whole batch, not copied per sequence
        prefix_runs = mx.array((gather[0, :shared][None, :] * h + heads[0]).astype(np.int32))
        gather = gather[:, shared:]
    runs = gather[:, None, :] * h + heads  # [B, H, K / block_size]
    first = shared * block_size
    kpos = np.broadcast_to(np.arange(first, k)[None, :], (b, k - first))
    kvalid = kpos < ends[:, None]

    # causal over absolute positions; padded query rows see key 0 so softmax stays finite
    mask = (kpos[:, None, :] <= qpos[:, :, None]) & kvalid[:, None, :]
    mask[:, :, 0] |= ~qvalid
    # a padded query row stands at the first key's position, so it keeps that one key under
    # any window (a row with no key would make its softmax NaN)
    qwin = np.where(qvalid, qpos, first)
    return (
        mx.array(runs.astype(np.int32)), mx.array(mask[:, None, :, :]), prefix_runs, qwin,
        np.arange(first, k),
    )  # fmt: skip


def additive_bias(mask: mx.array) -> mx.array:
    """A boolean mask (True = attend) as 0 / -inf to add to scores: built once per step, read
    by every layer."""
    return mx.where(mask, mx.array(0.0), mx.array(-mx.inf))


def _shared_prefix_blocks(table: np.ndarray, lens: np.ndarray, computed: int) -> int:
    """Leading blocks that every sequence of the step holds (same ids) and that were complete
    before the step, so every query sees all their keys. Worth it from two sequences on."""
    if table.shape[0] < 2 or computed == 0:
        return 0
    same = np.all(table[:, :computed] == table[:1, :computed], axis=0)
    n = int(np.argmin(same)) if not same.all() else computed
    return n if n and table[0, 0] != NULL_BLOCK_ID else 0


class PagedLayerCache:
    """One layer's view of the paged storage for one step (mlx-lm's cache protocol)."""

    def __init__(
        self, storage: PagedKVStorage, layer: int, layout: BatchLayout | PackedLayout
    ) -> None:
        self.storage = storage
        self.layer = layer
        self.layout = layout
        self.offset = layout.offsets  # per-sequence (padded) or per-token (packed) RoPE offsets
        self.prefix: tuple[mx.array, mx.array] | None = None  # shared prefix keys, values
        # packed: each segment's (keys, values, shared prefix or None), read by the attention
        self.segment_kv: list[tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, q, d = keys.shape  # [B, H, Q, D], after RoPE
        s, lay = self.storage, self.layout
        kpool = s.keys[self.layer]
        vpool = s.values[self.layer]
        # in-place scatter: MLX donates the old buffer, so a step costs its new rows only
        kpool[lay.write_rows] = keys.reshape(b * h * q, d).astype(s.dtype)
        vpool[lay.write_rows] = values.reshape(b * h * q, d).astype(s.dtype)
        run = s.block_size * d
        kruns, vruns = kpool.reshape(-1, run), vpool.reshape(-1, run)
        if isinstance(lay, PackedLayout):
            # the attention regroups the rows by segment; it needs no batch-shaped keys here
            self.segment_kv = [
                _fetch(kruns, vruns, seg.gather_runs, seg.prefix_runs, h, d, keys.dtype)
                if seg.dense is None
                else seg.dense.fetch(
                    self.layer,
                    kpool,
                    vpool,
                    keys[seg.first : seg.first + seg.length],
                    values[seg.first : seg.first + seg.length],
                )  # fmt: skip
                for seg in lay.segments
            ]
            return keys, values
        if lay.prefix_runs is not None:
            self.prefix = gather_prefix(kruns, vruns, lay.prefix_runs, h, d, keys.dtype)
        gk = kruns[lay.gather_runs].reshape(b, h, -1, d)
        gv = vruns[lay.gather_runs].reshape(b, h, -1, d)
        return gk.astype(keys.dtype), gv.astype(values.dtype)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        if window_size is not None:
            if isinstance(self.layout, PackedLayout):  # packed only for the host step
                raise NotImplementedError("sliding-window layers run padded steps in MLX")
            return self.layout.window_mask(window_size)
        if isinstance(self.layout, PackedLayout):
            return None  # each segment carries its own mask
        return self.layout.mask

    # mlx-lm checks these on some paths
    @property
    def state(self):  # pragma: no cover - not used for paged steps
        raise NotImplementedError

    def is_trimmable(self) -> bool:  # pragma: no cover
        return False


def _fetch(
    kruns: mx.array,
    vruns: mx.array,
    gather_runs: mx.array,
    prefix_runs: mx.array | None,
    h: int,
    d: int,
    dtype: mx.Dtype,
) -> tuple[mx.array, mx.array, tuple[mx.array, mx.array] | None]:
    b = gather_runs.shape[0]
    prefix = None
    if prefix_runs is not None:
        prefix = gather_prefix(kruns, vruns, prefix_runs, h, d, dtype)
    gk = kruns[gather_runs].reshape(b, h, -1, d).astype(dtype)
    gv = vruns[gather_runs].reshape(b, h, -1, d).astype(dtype)
    return gk, gv, prefix


def gather_prefix(
    kruns: mx.array, vruns: mx.array, prefix_runs: mx.array, h: int, d: int, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """A shared prefix's keys and values [H, P, D] from a layer's runs (storage viewed as
    [runs, block_size * D]): read once for the whole batch by cascade attention."""
    return (
        kruns[prefix_runs].reshape(h, -1, d).astype(dtype),
        vruns[prefix_runs].reshape(h, -1, d).astype(dtype),
    )
