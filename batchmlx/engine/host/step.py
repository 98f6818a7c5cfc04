"""Packed steps of a llama-family model in a host weight format, run on the host alone.

On MLX's CPU backend a host-format step (engine/host/linear.py) hands every GEMM's input to
the host through an evaluation barrier: 121 a step at 135M, ~350 us each, 42 ms of a width-8
decode step's 81 (measured 2026-12-02), and the norms, RoPE and SwiGLU between them run in
MLX's slow CPU elementwise kernels. Here a packed step (decodes, prompt chunks, or both) runs
as numpy and oneDNN calls over the very same packed weights, paged KV pool and decodes' dense
copy (kv/decode.py), each segment's attention in host_attention's kernels, and only the logits
go back to MLX, in a buffer MLX owns. Models this does not know keep the MLX path; both read
and write the same KV, so the two paths can take turns on one sequence.

The arithmetic is the MLX path's: float32 activations, GEMM inputs rounded to bf16 (or
quantized per token for int8, or as they are for float32) exactly as host_linear does,
float32 norms, RoPE and softmax; only the order of float32 sums differs (logits within ~1e-5
of the MLX path's, greedy tokens equal: tests/engine/test_host_step.py).
BATCHMLX_HOST_STEPS=0 turns it off (HostSettings.host_steps, of the HostBackend the model's host
layers were built with: engine/host/backend.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host import attention as host_attention
from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.elementwise import swiglu_halves
from batchmlx.engine.host.linear import HostEmbedding, HostFormat, HostLinear, SharedGemm
from batchmlx.engine.kv.decode import DecodePlan
from batchmlx.engine.kv.paged import PackedLayout, PagedKVStorage, Segment, SegmentKind

log = logging.getLogger("batchmlx.engine")

# mlx-lm architectures whose blocks are exactly llama's: x + attn(norm(x)), then + mlp(norm(.)),
# q/k/v/o projections (biases allowed), plain RoPE, SwiGLU MLP
ARCHITECTURES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.mistral")


def backend_of(model: nn.Module) -> HostBackend:
    """The HostBackend `model`'s host layers were built with (else the process's)."""
    gemm = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "_gemm", None)
    return gemm.backend if isinstance(gemm, SharedGemm) else current()


@dataclass(frozen=True, slots=True)
class _Block:
    """One transformer block's host pieces."""

    ln1: np.ndarray  # input RMSNorm weight, float32
    ln2: np.ndarray  # post-attention RMSNorm weight
    qkv: SharedGemm  # q, k and v in one GEMM
    o: SharedGemm
    gate_up: SharedGemm  # gate and up in one GEMM
    down: SharedGemm


@dataclass(frozen=True, slots=True)
class HostRope:
    """nn.RoPE of a model's q and k heads, in numpy (its dims, traditional, base, scale)."""

    dims: int
    traditional: bool
    base: float
    scale: float
    head_dim: int
    heads: int  # query + KV heads, rotated in one pass

    def tables(self, positions: np.ndarray) -> _RopeTables:
        """Each row's cos and signed sin over the q and k heads' elements, for its position (as
        elementwise.rope_table): `rotate` reads them as whole rows."""
        half = self.dims // 2
        inv = np.exp(
            np.arange(0, -half, -1, dtype=np.float32) * np.float32(math.log(self.base) / half)
        )
        theta = (positions.astype(np.float32) * np.float32(self.scale))[:, None] * inv
        cos, sin = np.cos(theta), np.sin(theta)
        t, d = positions.shape[0], self.head_dim
        c, s = np.ones((t, d), np.float32), np.zeros((t, d), np.float32)  # past dims: as is
        first, second = self._pairs()
        c[:, first], c[:, second] = cos, cos
        s[:, first], s[:, second] = -sin, sin
        return _RopeTables(np.tile(c, (1, self.heads)), np.tile(s, (1, self.heads)))

    def _pairs(self) -> tuple[slice, slice]:
        """The elements of a head rotated together: (first, second) of each pair."""
        if self.traditional:  # pairs (2i, 2i + 1)
            return slice(0, self.dims, 2), slice(1, self.dims, 2)
        return slice(0, self.dims // 2), slice(self.dims // 2, self.dims)  # (i, i + dims / 2)

    def rotate(self, x: np.ndarray, rope: _RopeTables) -> np.ndarray:
        """x [T, heads, D] (a view of the GEMM's rows) rotated by its row's position, a new
        array: x * cos + swapped(x) * signed sin, where swapped exchanges each pair. The
        products and sums are nn.RoPE's (x1 cos - x2 sin, x1 sin + x2 cos), bit for bit, in
        three whole-row passes and a copy; per half-head views took 3.5x as long (1,776
        prompt tokens, alone: 3.3 ms a layer against 0.95; a width-64 prefill's RoPE 162 ->
        110 ms)."""
        t, n, d = x.shape
        first, second = self._pairs()
        sw = np.empty((t, n, d), np.float32)
        sw[..., first], sw[..., second] = x[..., second], x[..., first]
        if self.dims < d:
            sw[..., self.dims :] = 0  # times a sin of 0: the unrotated dims stay as they are
        out = np.multiply(x.reshape(t, n * d), rope.cos)
        sw = sw.reshape(t, n * d)
        sw *= rope.sin
        out += sw
        return out.reshape(t, n, d)


def _gemm(layer: object, members: int) -> SharedGemm | None:
    """The SharedGemm behind a HostLinear that reads its input with `members - 1` siblings."""
    if not isinstance(layer, HostLinear):
        return None
    g = layer._gemm
    return g if len(g.splits) == members else None


def unsupported(model: nn.Module, storage: PagedKVStorage) -> str | None:
    """Why `model` cannot run host steps over `storage` (None: it can)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers:
        return "no model.layers"
    if storage.dtype != mx.float32:
        return f"KV stored as {storage.dtype}"
    if not isinstance(getattr(inner, "embed_tokens", None), HostEmbedding):
        return "embedding not in a host format"
    head = getattr(model, "lm_head", None)
    if head is not None and _gemm(head, 1) is None:
        return "lm_head not in a host format"
    first = layers[0]
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (
            type(layer).__module__ not in ARCHITECTURES
            or type(attn).__module__ != type(layer).__module__
        ):
            return f"architecture {type(layer).__module__}"
        if type(attn.rope) is not nn.RoPE:
            return f"rope {type(attn.rope).__name__}"
        if any(_gemm(getattr(attn, n, None), 3) is None for n in ("q_proj", "k_proj", "v_proj")):
            return "q, k, v not one host GEMM"
        if _gemm(attn.o_proj, 1) is None or _gemm(mlp.down_proj, 1) is None:
            return "o_proj or down_proj not a host GEMM"
        if any(_gemm(getattr(mlp, n, None), 2) is None for n in ("gate_proj", "up_proj")):
            return "gate and up not one host GEMM"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if type(norm) is not nn.RMSNorm:
                return f"norm {type(norm).__name__}"
        for name in ("n_heads", "n_kv_heads", "scale"):
            if getattr(attn, name, None) != getattr(first.self_attn, name, None):
                return "blocks of different shapes"
    if type(inner.norm) is not nn.RMSNorm:
        return "final norm"
    return None


class HostStep:
    """Runs the packed steps of a supported model on the host (see the module doc)."""

    def __init__(
        self, model: nn.Module, storage: PagedKVStorage, backend: HostBackend | None = None
    ) -> None:
        inner = model.model
        self.backend = backend_of(model) if backend is None else backend
        attn = inner.layers[0].self_attn
        self.storage = storage
        self.n_heads = int(attn.n_heads)
        self.n_kv = int(attn.n_kv_heads)
        self.head_dim = storage.head_dim
        self.scale = np.float32(attn.scale)
        r = attn.rope
        self.rope = HostRope(int(r.dims), bool(r.traditional), float(r.base), float(r.scale),
                             storage.head_dim, self.n_heads + self.n_kv)  # fmt: skip
        self.eps = np.float32(inner.layers[0].input_layernorm.eps)
        self.final_eps = np.float32(inner.norm.eps)
        self.final_norm = np.asarray(inner.norm.weight.astype(mx.float32))
        emb: HostEmbedding = inner.embed_tokens
        # bf16: the rows' bits as uint16; int8: the rows and their scales; float32: the rows
        self._embed_bits = emb._gemm.fmt is HostFormat.BF16
        self._embed = emb.host_rows()
        scales = emb.get("scales")
        self._embed_scales = None if scales is None else np.asarray(scales)
        head = getattr(model, "lm_head", None)
        self.head: SharedGemm = emb._gemm if head is None else head._gemm
        self.blocks = [
            _Block(
                ln1=np.asarray(layer.input_layernorm.weight.astype(mx.float32)),
                ln2=np.asarray(layer.post_attention_layernorm.weight.astype(mx.float32)),
                qkv=layer.self_attn.q_proj._gemm,
                o=layer.self_attn.o_proj._gemm,
                gate_up=layer.mlp.gate_proj._gemm,
                down=layer.mlp.down_proj._gemm,
            )
            for layer in inner.layers
        ]
        self.steps = 0  # steps run here (tests and benchmarks read it)

    @classmethod
    def of(cls, model: nn.Module, storage: PagedKVStorage) -> HostStep | None:
        """Host steps for `model`, or None when they are off or the model is not one they run."""
        backend = backend_of(model)
        if not backend.settings.host_steps:
            return None
        why = unsupported(model, storage)
        if why is not None:
            host_layers = any(isinstance(m, HostLinear) for _, m in model.named_modules())
            if host_layers:  # a host format whose steps stay in MLX: say why, once a load
                log.info("steps run in MLX, not on the host alone: %s", why)
            return None
        return cls(model, storage, backend)

    @staticmethod
    def runs(layout: object) -> bool:
        """Whether this step is one it runs: a packed one (every segment kind)."""
        return isinstance(layout, PackedLayout)

    # -- the step ------------------------------------------------------------------------------
    def forward(self, layout: PackedLayout, rows: list[int] | None) -> mx.array:
        """Logits [len(rows), V] of the step's sequences `rows` (None: all), as an evaluated
        MLX array; the step's keys and values written to the pool (and the dense copy)."""
        storage = self.storage
        mx.eval(storage.keys, storage.values, layout.tokens, layout.offsets, layout.write_rows)
        tokens = np.asarray(layout.tokens).reshape(-1)
        t = tokens.shape[0]
        x = self._embedding(tokens)  # [T, hidden] float32
        rope = self.rope.tables(np.asarray(layout.offsets))
        kv = _StepKV(storage, layout, self.backend)
        hq, h, d = self.n_heads, self.n_kv, self.head_dim
        k_end = (hq + h) * d
        for i, blk in enumerate(self.blocks):
            hn = _rms_norm(x, blk.ln1, self.eps)
            qkv = blk.qkv.host(hn)
            # q and k rotated in one pass (adjacent in the GEMM's rows), then q scaled
            qk = self.rope.rotate(qkv[:, :k_end].reshape(t, hq + h, d), rope)
            q, k = qk[:, :hq], qk[:, hq:]
            q *= self.scale
            v = qkv[:, k_end:].reshape(t, h, d)
            o = kv.attend(i, q, k, np.ascontiguousarray(v))
            x += blk.o.host(o.reshape(t, hq * d))
            hn = _rms_norm(x, blk.ln2, self.eps)
            x += blk.down.host(swiglu_halves(blk.gate_up.host(hn), backend=self.backend))
        last = np.asarray(layout.last_index)
        if rows is not None:
            last = last[np.asarray(rows, dtype=np.int64)]
        hn = _rms_norm(np.ascontiguousarray(x[last]), self.final_norm, self.final_eps)
        logits = mx.zeros((hn.shape[0], self.head._w.n), mx.float32)
        mx.eval(logits)
        self.head.host(hn, np.asarray(logits))  # into MLX's buffer: no copy back
        self.steps += 1
        return logits

    def _embedding(self, tokens: np.ndarray) -> np.ndarray:
        rows = self._embed[tokens]
        if self._embed_bits:  # bf16 bits -> float32: the high half of the word
            return (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        if self._embed_scales is None:
            return rows
        return rows.astype(np.float32) * self._embed_scales[tokens][:, None]


@dataclass(frozen=True, slots=True)
class _RopeTables:
    """A step's RoPE factors, [T, (query + KV heads) x head_dim]."""

    cos: np.ndarray  # 1 on the dims RoPE leaves alone
    sin: np.ndarray  # -sin on a pair's first element, +sin on its second; 0 on dims left alone


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """mx.fast.rms_norm in float32: x / sqrt(mean(x^2) + eps) * weight."""
    ms = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[1])
    r = np.float32(1.0) / np.sqrt(ms + eps)
    out = x * r[:, None]
    out *= weight
    return out


class _StepKV:
    """One host step's keys and values: every token's new rows into the pool (and the decodes'
    into their dense copy, when the step has its plan), and each segment's attention over the
    keys its rows see, as attention._segment regroups them. The pool's and the copy's arrays
    are MLX's, evaluated; they are written through numpy views of their buffers, as the MLX
    path's in-place scatters write them."""

    def __init__(self, storage: PagedKVStorage, layout: PackedLayout, backend: HostBackend) -> None:
        self.storage = storage
        self.run = storage.block_size * storage.head_dim
        self.write_rows = np.asarray(layout.write_rows)  # token-major, then head
        self.segments = [_SegmentPlan.of(seg, backend) for seg in layout.segments]

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [T, Hq, D] (scaled, rotated), k, v [T, H, D] (k rotated): writes k, v and returns
        the attention output [T, Hq, D] in row order."""
        s = self.storage
        t, h, d = k.shape
        kpool, vpool = _view(s.keys[layer]), _view(s.values[layer])
        kpool[self.write_rows] = k.reshape(t * h, d)
        vpool[self.write_rows] = v.reshape(t * h, d)
        kr, vr = kpool.reshape(-1, self.run), vpool.reshape(-1, self.run)
        out = np.empty(q.shape, np.float32)
        for p in self.segments:
            rows = slice(p.seg.first, p.seg.first + p.seg.length)
            out[rows] = p.attend(layer, q[rows], k[rows], v[rows], kpool, vpool, kr, vr)
        return out


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

    @classmethod
    def of(cls, seg: Segment, backend: HostBackend | None = None) -> _SegmentPlan:
        plan = seg.dense
        if plan is not None:
            return cls(seg, np.asarray(plan.bias), None, None, _DensePlan.of(plan),
                       backend=backend)  # fmt: skip
        p = cls(seg, np.asarray(seg.bias), np.asarray(seg.gather_runs),
                None if seg.prefix_runs is None else np.asarray(seg.prefix_runs),
                backend=backend)  # fmt: skip
        if seg.kind is SegmentKind.CHUNKS:
            p.pad_rows, p.real_rows = np.asarray(seg.pad_rows), np.asarray(seg.real_rows)
            if p.prefix_runs is not None and seg.queries <= host_attention.TILE_QUERIES:
                valid = np.zeros(seg.batch * seg.queries, dtype=bool)
                valid[p.real_rows] = True
                p.valid = valid.reshape(seg.batch, seg.queries)
        return p

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               kpool: np.ndarray, vpool: np.ndarray, kr: np.ndarray,
               vr: np.ndarray) -> np.ndarray:  # fmt: skip
        """This segment's rows: q [n, Hq, D], k, v [n, H, D] -> [n, Hq, D]."""
        seg = self.seg
        n, hq, d = q.shape
        h = k.shape[1]
        rep = hq // h
        if self.dense is not None:
            keys, values, prefix = self.dense.fetch(layer, kpool, vpool, k, v)
            dp = self.dense
            qs = q if dp.slot_rows is None else q[dp.slot_rows]
            o = host_attention.decode_attention(qs.reshape(-1, h, rep, d), keys, values,
                                                self.bias, prefix, self.backend)  # fmt: skip
            o = o.reshape(-1, hq, d)
            return o if dp.row_slots is None else o[dp.row_slots]
        b = seg.batch
        keys = kr[self.gather].reshape(b, h, -1, d)
        values = vr[self.gather].reshape(b, h, -1, d)
        prefix = None
        if self.prefix_runs is not None:
            prefix = (kr[self.prefix_runs].reshape(h, -1, d),
                      vr[self.prefix_runs].reshape(h, -1, d))  # fmt: skip
        if seg.kind is SegmentKind.ROWS:
            o = host_attention.decode_attention(q.reshape(n, h, rep, d), keys, values,
                                                self.bias, prefix, self.backend)  # fmt: skip
            return o.reshape(n, hq, d)
        if seg.kind is SegmentKind.CHUNK:  # one sequence: [1, H, rep, L, D]
            q5 = q.transpose(1, 0, 2).reshape(1, h, rep, n, d)
        else:  # padded chunks: [B, H, rep, Q, D]
            q5 = q[self.pad_rows].reshape(b, seg.queries, h, rep, d).transpose(0, 2, 3, 1, 4)
        o = host_attention._attend(np.ascontiguousarray(q5), keys, values, self.bias,
                                   seg.causal_offset, host_attention.TILE_QUERIES, prefix,
                                   self.valid, self.backend)  # fmt: skip
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
                        out=_view(buf).reshape(-1, run))  # fmt: skip
                arrays[layer] = buf
                arr = _view(buf)
            else:
                arr = _view(arrays[layer])
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
            prefix = (_view(pk), _view(pv))
        return out[0], out[1], prefix


def _view(a: mx.array) -> np.ndarray:
    """A writable numpy view of an evaluated float32 MLX array's buffer."""
    mx.eval(a)
    out = np.asarray(a)
    if not out.flags.writeable:  # pragma: no cover - MLX exported a read-only buffer
        raise RuntimeError("MLX array not writable through numpy")
    return out
