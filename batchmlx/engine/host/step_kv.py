"""A host step's keys and values (engine/host/step.py): each token's new rows written to the
paged pool, and each segment's attention over the keys its rows see. Decode rows, and each
query of a prompt chunk, attend straight from the pool through their block tables in the paged
kernel (engine/host/paged_attention.py: no gather, no dense copy, batch-invariant by
construction), where it runs; a step's prompt queries in one call of it (_PromptRows: tiles
where the CPU has them); elsewhere through the decodes' dense copy (kv/decode.py) and
gathered keys in engine/host/attention.py's kernels. A sliding-window layer's
segments add their window to the step's mask (built once a step per window size; the paged
kernel takes the window itself); gemma2's soft-capped scores go through the same kernels with
their cap.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from batchmlx.engine.host import attention as host_attention
from batchmlx.engine.host import paged_attention, q8
from batchmlx.engine.host.backend import HostBackend
from batchmlx.engine.kv.decode import DecodePlan
from batchmlx.engine.kv.paged import PackedLayout, PagedKVStorage, Segment, SegmentKind


class StepKV:
    """One host step's keys and values: every token's new rows into the pool (and the decodes'
    into their dense copy, when the step has its plan), and each segment's attention over the
    keys its rows see, as attention._segment regroups them. The pool's and the copy's arrays
    are MLX's, evaluated; they are written through numpy views of their buffers, as the MLX
    path's in-place scatters write them."""

    def __init__(self, storage: PagedKVStorage, layout: PackedLayout, backend: HostBackend) -> None:
        self.storage = storage
        self.run = storage.block_size * storage.head_dim
        # token-major, then head; checked against the pool once for every layer
        self.write_rows = paged_attention.WriteRows.of(np.asarray(layout.write_rows),
                                                       storage.keys[0].shape[0])  # fmt: skip
        self.segments = [_SegmentPlan.of(seg, backend) for seg in layout.segments]
        self.decode_step = _decode_step(self.segments, self.write_rows, storage, backend)
        # (a step the fused call takes is one segment: its chunk's rows already one call)
        self.prompts = _PromptRows.of(self.segments) if self.decode_step is None else None

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               window: int | None = None, softcap: float | None = None) -> np.ndarray:  # fmt: skip
        """q [T, Hq, D] (scaled, rotated), k, v [T, H, D] (k rotated): writes k, v and returns
        the attention output [T, Hq, D] in row order. window: the layer sees each query's last
        `window` keys only; softcap: its scores are soft-capped (gemma2)."""
        s = self.storage
        t, h, d = k.shape
        kpool, vpool = view(s.keys[layer]), view(s.values[layer])
        fused = self.decode_step
        if (
            fused is not None
            and paged_attention.takes(d, q.shape[1] // h)
            and _kernel_pool(kpool, vpool)
        ):
            return fused.layer(q, k, v, kpool, vpool, window, softcap)
        paged_attention.scatter(kpool, self.write_rows, k.reshape(t * h, d))
        paged_attention.scatter(vpool, self.write_rows, v.reshape(t * h, d))
        kr, vr = kpool.reshape(-1, self.run), vpool.reshape(-1, self.run)
        out = np.empty(q.shape, np.float32)
        prompts = self.prompts if paged_attention.takes(d, q.shape[1] // h) else None
        if prompts is not None:
            out[prompts.at] = prompts.attend(q[prompts.at], kpool, vpool, h, s.block_size, window,
                                             softcap)  # fmt: skip
        for p in self.segments:
            if prompts is not None and id(p) in prompts.ids:
                continue
            rows = slice(p.seg.first, p.seg.first + p.seg.length)
            out[rows] = p.attend(layer, q[rows], k[rows], v[rows], kpool, vpool, kr, vr,
                                 window, softcap)  # fmt: skip
        return out


def _decode_step(
    segments: list[_SegmentPlan],
    write: paged_attention.WriteRows,
    storage: PagedKVStorage,
    backend: HostBackend,
) -> paged_attention.DecodeStep | None:
    """A step of one segment of kernel rows (decodes alone, or one prompt chunk's queries),
    with the GEMMs' workers to run them: its layers each one kernel call
    (paged_attention.DecodeStep); else None."""
    if len(segments) != 1:
        return None
    (p,) = segments
    runner = q8.pool_runner()
    if p.rows is None or p.dense is not None or p.seg.first != 0 or runner is None:
        return None
    if p.seg.length * storage.n_kv_heads != write.rows.shape[0]:
        return None
    return paged_attention.DecodeStep(write, p.rows, storage.n_kv_heads, storage.block_size,
                                      runner, backend.threads.or_cpus())  # fmt: skip


@dataclass(slots=True)
class _PromptRows:
    """The queries of a step's prompt chunks as one call of the paged kernel, which takes them
    through tiles where they run (DecodeRows.tiles): 64 chats behind one system prompt score
    its keys in the same tile products, not 64 calls of one chunk each. at: their rows in the
    step (each chunk's together); ids: the segment plans they come from."""

    at: slice | np.ndarray
    rows: paged_attention.DecodeRows
    ids: frozenset[int]
    backend: HostBackend | None

    @classmethod
    def of(cls, segments: list[_SegmentPlan]) -> _PromptRows | None:
        plans = [p for p in segments if p.seg.kind is SegmentKind.CHUNK and p.rows is not None
                 and p.dense is None]  # fmt: skip
        if not plans:
            return None
        width = max(p.rows.tables.shape[1] for p in plans)
        tables = np.concatenate([np.pad(t, ((0, 0), (0, width - t.shape[1])))
                                 for t in (p.rows.tables for p in plans)])  # fmt: skip
        same = (tables == tables[:1]).all(axis=0)
        shared = width if same.all() else int(np.argmin(same))
        firsts = [p.seg.first for p in plans]
        ends = [p.seg.first + p.seg.length for p in plans]
        at: slice | np.ndarray = slice(firsts[0], ends[-1])
        if any(a != b for a, b in zip(firsts[1:], ends[:-1], strict=True)):
            at = np.concatenate([np.arange(a, b) for a, b in zip(firsts, ends, strict=True)])
        counts = np.concatenate([p.rows.counts for p in plans])
        rows = paged_attention.DecodeRows.of(tables, counts, shared, tiles=True)
        return cls(at, rows, frozenset(id(p) for p in plans), plans[0].backend)

    def attend(self, q: np.ndarray, kpool: np.ndarray, vpool: np.ndarray, kv_heads: int,
               block_size: int, window: int | None,
               softcap: float | None) -> np.ndarray:  # fmt: skip
        """The prompt rows' attention: q [rows, Hq, D] -> [rows, Hq, D]."""
        return _paged(q, kpool, vpool, self.rows, kv_heads, block_size, window, softcap,
                      self.backend)  # fmt: skip


def _paged(q: np.ndarray, kpool: np.ndarray, vpool: np.ndarray, rows: paged_attention.DecodeRows,
           kv_heads: int, block_size: int, window: int | None, softcap: float | None,
           backend: HostBackend | None) -> np.ndarray:  # fmt: skip
    """paged_attention.decode of `rows`, on the GEMMs' workers where they run (no Python
    hand-off, no third thread), else on the backend's pool."""
    if backend is None:
        return paged_attention.decode(q, kpool, vpool, rows, kv_heads, block_size, window=window,
                                      softcap=softcap)  # fmt: skip
    runner = q8.pool_runner()
    return paged_attention.decode(
        q, kpool, vpool, rows, kv_heads, block_size, window=window, softcap=softcap,
        pool=None if runner else backend.pool(),
        threads=backend.threads.or_cpus() if runner else backend.pool_threads, runner=runner,
    )  # fmt: skip


def _kernel_pool(kpool: np.ndarray, vpool: np.ndarray) -> bool:
    """Whether the decode kernel reads these pools as they are."""
    return (kpool.dtype == vpool.dtype and kpool.dtype in paged_attention.POOL_DTYPES
            and kpool.flags.c_contiguous and vpool.flags.c_contiguous)  # fmt: skip


@dataclass(slots=True)
class _SegmentPlan:
    """One segment's indices as numpy (read once a step, used by every layer)."""

    seg: Segment
    bias: np.ndarray
    gather: np.ndarray | None  # [B, H, K / block_size] pool runs (no dense copy)
    prefix_runs: np.ndarray | None  # [H, P / block_size] a shared prefix's runs
    dense: _DensePlan | None = None
    pad_rows: np.ndarray | None = None  # CHUNKS
    real_rows: np.ndarray | None = None
    valid: np.ndarray | None = None  # CHUNKS behind a prefix: [B, Q] the real queries
    backend: HostBackend | None = None  # its attention's thread pool and oneDNN
    windows: dict[int, np.ndarray] = field(default_factory=dict)  # bias within each window
    rows: paged_attention.DecodeRows | None = None  # ROWS: what the paged kernel reads

    @classmethod
    def of(cls, seg: Segment, backend: HostBackend | None = None) -> _SegmentPlan:
        plan = seg.dense
        if plan is not None:
            return cls(seg, np.asarray(plan.bias), None, None, _DensePlan.of(plan),
                       backend=backend)  # fmt: skip
        p = cls(seg, np.asarray(seg.bias), np.asarray(seg.gather_runs),
                None if seg.prefix_runs is None else np.asarray(seg.prefix_runs),
                backend=backend)  # fmt: skip
        if seg.kind is SegmentKind.ROWS and seg.block_table is not None:
            assert seg.query_pos is not None
            shared = 0 if p.prefix_runs is None else p.prefix_runs.shape[1]
            p.rows = paged_attention.DecodeRows.of(seg.block_table, seg.query_pos[:, 0] + 1, shared)
        if seg.kind is SegmentKind.CHUNK and seg.block_table is not None:
            # each query of the chunk a row of the paged kernel, its sequence's table and the
            # keys up to its own: what a decode row of that position computes, so a prompt's
            # token has the same bits however the prompt was cut into chunks, and no step
            # gathers its keys (64 chunks of ~28 tokens behind a ~900-token prefix: each
            # gathered the prefix and scored it in padded numpy tiles). Every row's table is
            # the same blocks: all of them walked block-major (read once for the rows a
            # thread takes), the same (row, block) steps in the same order as alone
            assert seg.query_pos is not None
            counts = seg.query_pos[0, : seg.length] + 1
            tables = np.broadcast_to(seg.block_table, (seg.length, seg.block_table.shape[1]))
            p.rows = paged_attention.DecodeRows.of(tables, counts, seg.block_table.shape[1],
                                                   tiles=True)  # fmt: skip
        if seg.kind is SegmentKind.CHUNKS:
            p.pad_rows, p.real_rows = np.asarray(seg.pad_rows), np.asarray(seg.real_rows)
            if p.prefix_runs is not None and seg.queries <= host_attention.TILE_QUERIES:
                valid = np.zeros(seg.batch * seg.queries, dtype=bool)
                valid[p.real_rows] = True
                p.valid = valid.reshape(seg.batch, seg.queries)
        return p

    def window_bias(self, window: int) -> np.ndarray:
        """The step's bias with the keys outside each query's last `window` masked too (as
        BatchLayout.window_mask, and mlx-lm's mask for a rotating cache of that size)."""
        if window not in self.windows:
            if self.dense is not None:  # a slot's key j is at position j
                pos = self.dense.plan.positions
                if pos is None:
                    raise NotImplementedError("a window behind a shared prefix")
                keys = np.arange(self.bias.shape[-1])
                near = (keys[None, :] > pos[:, None] - window)[:, None, None, :]
            else:
                if self.prefix_runs is not None:
                    raise NotImplementedError("a window behind a shared prefix")
                qpos, kpos = self.seg.query_pos, self.seg.key_pos
                assert qpos is not None and kpos is not None
                near = (kpos[None, None, :] > qpos[:, :, None] - window)[:, None]
            self.windows[window] = np.where(near, self.bias, np.float32(-np.inf))
        return self.windows[window]

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               kpool: np.ndarray, vpool: np.ndarray, kr: np.ndarray,
               vr: np.ndarray, window: int | None = None,
               softcap: float | None = None) -> np.ndarray:  # fmt: skip
        """This segment's rows: q [n, Hq, D], k, v [n, H, D] -> [n, Hq, D]."""
        seg = self.seg
        n, hq, d = q.shape
        h = k.shape[1]
        rep = hq // h
        if self.rows is not None and self.dense is None and paged_attention.takes(d, rep):
            return _paged(q, kpool, vpool, self.rows, h, kr.shape[1] // d, window, softcap,
                          self.backend)  # fmt: skip
        bias = self.bias if window is None else self.window_bias(window)
        if self.dense is not None:
            keys, values, prefix = self.dense.fetch(layer, kpool, vpool, k, v)
            dp = self.dense
            qs = q if dp.slot_rows is None else q[dp.slot_rows]
            o = host_attention.decode_attention(qs.reshape(-1, h, rep, d), keys, values,
                                                bias, prefix, self.backend,
                                                softcap)  # fmt: skip
            o = o.reshape(-1, hq, d)
            return o if dp.row_slots is None else o[dp.row_slots]
        b = seg.batch
        gather = paged_attention.gather  # float32 (a float16 pool's rows widened)
        keys = gather(kr, self.gather).reshape(b, h, -1, d)
        values = gather(vr, self.gather).reshape(b, h, -1, d)
        prefix = None
        if self.prefix_runs is not None:
            prefix = (gather(kr, self.prefix_runs).reshape(h, -1, d),
                      gather(vr, self.prefix_runs).reshape(h, -1, d))  # fmt: skip
        if seg.kind is SegmentKind.ROWS:
            o = host_attention.decode_attention(q.reshape(n, h, rep, d), keys, values,
                                                bias, prefix, self.backend, softcap)  # fmt: skip
            return o.reshape(n, hq, d)
        if seg.kind is SegmentKind.CHUNK:  # one sequence: [1, H, rep, L, D]
            q5 = q.transpose(1, 0, 2).reshape(1, h, rep, n, d)
        else:  # padded chunks: [B, H, rep, Q, D]
            q5 = q[self.pad_rows].reshape(b, seg.queries, h, rep, d).transpose(0, 2, 3, 1, 4)
        o = host_attention._attend(np.ascontiguousarray(q5), keys, values, bias,
                                   seg.causal_offset, host_attention.TILE_QUERIES, prefix,
                                   self.valid, self.backend, softcap)  # fmt: skip
        if seg.kind is SegmentKind.CHUNK:
            return o.reshape(hq, n, d).transpose(1, 0, 2)
        o = o.reshape(b, hq, seg.queries, d).transpose(0, 2, 1, 3).reshape(-1, hq, d)
        return o[self.real_rows]


@dataclass(slots=True)
class _DensePlan:
    """A DecodePlan's indices as numpy; `fetch` is DecodePlan.fetch in numpy."""

    plan: DecodePlan
    write_rows: np.ndarray
    join: tuple[np.ndarray, np.ndarray] | None
    rebuild: np.ndarray | None
    prefix_runs: np.ndarray | None
    slot_rows: np.ndarray | None
    row_slots: np.ndarray | None

    @classmethod
    def of(cls, plan: DecodePlan) -> _DensePlan:
        def host(a: mx.array | None) -> np.ndarray | None:
            return None if a is None else np.asarray(a)

        join = None if plan.join_rows is None else (host(plan.join_rows), host(plan.join_src))
        rebuild = None if plan.rebuild_runs is None else np.asarray(plan.rebuild_runs).reshape(-1)
        return cls(plan, np.asarray(plan.write_rows), join, rebuild, host(plan.prefix_runs),
                   host(plan.slot_rows), host(plan.row_slots))  # fmt: skip

    def fetch(self, layer: int, kpool: np.ndarray, vpool: np.ndarray, k: np.ndarray,
              v: np.ndarray) -> tuple:  # fmt: skip
        """The copy's keys and values [S, H, L, D] with the new rows in, and the shared
        prefix's [H, P, D] (or None)."""
        plan = self.plan
        kv = plan.owner
        d = kpool.shape[-1]
        run = kv.block_size * d
        out = []
        for pool, new, arrays in ((kpool, k, kv.keys), (vpool, v, kv.values)):
            if self.rebuild is not None:  # the pool already holds the step's new rows
                buf = mx.zeros((self.rebuild.shape[0] * kv.block_size, d), mx.float32)
                mx.eval(buf)
                np.take(pool.reshape(-1, run), self.rebuild, axis=0,
                        out=view(buf).reshape(-1, run))  # fmt: skip
                arrays[layer] = buf
                arr = view(buf)
            else:
                arr = view(arrays[layer])
                if self.join is not None:
                    arr[self.join[0]] = pool[self.join[1]]
                arr[self.write_rows] = new.reshape(-1, d)
            out.append(arr.reshape(plan.slots, kv.n_kv_heads, plan.capacity, d))
        if self.prefix_runs is not None:  # gathered this step, kept while shared
            h = kv.n_kv_heads
            kp = kpool.reshape(-1, run)[self.prefix_runs].reshape(h, -1, d)
            vp = vpool.reshape(-1, run)[self.prefix_runs].reshape(h, -1, d)
            kv.prefix[layer] = (mx.array(kp), mx.array(vp))
        prefix = None
        if kv.prefix_blocks:
            pk, pv = kv.prefix[layer]
            prefix = (view(pk), view(pv))
        return out[0], out[1], prefix


def view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated MLX array's buffer (the pool: float32 or float16;
    written through it, numpy rounds float32 rows to float16 to nearest even, as MLX does)."""
    mx.eval(a)
    out = np.asarray(a)
    if not out.flags.writeable:  # pragma: no cover - MLX exported a read-only buffer
        raise RuntimeError("MLX array not writable through numpy")
    return out
