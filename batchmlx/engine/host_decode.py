"""Decode steps of a llama-family model in a host weight format, run on the host alone.

On MLX's CPU backend a host-format step (kernels/host_linear.py) hands every GEMM's input to
the host through an evaluation barrier: 121 a step at 135M, ~350 us each, 42 ms of a width-8
decode step's 81 (measured 2026-12-02), and the norms, RoPE and SwiGLU between them run in
MLX's slow CPU elementwise kernels. A step in which every row decodes one token is the same
short chain of work each time, so here it runs as numpy and oneDNN calls over the very same
packed weights, paged KV pool and decodes' dense copy (kv/decode.py), and only the logits go
back to MLX, in a buffer MLX owns. Steps with a prompt chunk, and models this does not know,
keep the MLX path; both read and write the same KV, so a sequence moves between them freely.

The arithmetic is the MLX path's: float32 activations, GEMM inputs rounded to bf16 (or
quantized per token for int8) exactly as host_linear does, float32 norms, RoPE and softmax;
only the order of float32 sums differs (logits within ~1e-5 of the MLX path's, greedy tokens
equal: tests/engine/test_host_decode.py). BATCHMLX_HOST_DECODE=0 turns it off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.kernels import host_attention
from batchmlx.engine.kernels.host_linear import HostEmbedding, HostFormat, HostLinear, SharedGemm
from batchmlx.engine.kv.paged import PackedLayout, PagedKVStorage, Segment, SegmentKind

ENV = "BATCHMLX_HOST_DECODE"
# mlx-lm architectures whose blocks are exactly llama's: x + attn(norm(x)), then + mlp(norm(.)),
# q/k/v/o projections (biases allowed), plain RoPE, SwiGLU MLP
ARCHITECTURES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.mistral")


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


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
class _Rope:
    dims: int
    traditional: bool
    base: float
    scale: float


def _gemm(layer: object, members: int) -> SharedGemm | None:
    """The SharedGemm behind a HostLinear that reads its input with `members - 1` siblings."""
    if not isinstance(layer, HostLinear):
        return None
    g = layer._gemm
    return g if len(g.splits) == members else None


def unsupported(model: nn.Module, storage: PagedKVStorage) -> str | None:
    """Why `model` cannot run host decode steps over `storage` (None: it can)."""
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


class HostDecoder:
    """Runs decode-only packed steps of a supported model on the host (see the module doc)."""

    def __init__(self, model: nn.Module, storage: PagedKVStorage) -> None:
        inner = model.model
        attn = inner.layers[0].self_attn
        self.storage = storage
        self.n_heads = int(attn.n_heads)
        self.n_kv = int(attn.n_kv_heads)
        self.head_dim = storage.head_dim
        self.scale = np.float32(attn.scale)
        r = attn.rope
        self.rope = _Rope(int(r.dims), bool(r.traditional), float(r.base), float(r.scale))
        self.eps = np.float32(inner.layers[0].input_layernorm.eps)
        self.final_eps = np.float32(inner.norm.eps)
        self.final_norm = np.asarray(inner.norm.weight.astype(mx.float32))
        emb: HostEmbedding = inner.embed_tokens
        self._embed_fmt = emb._gemm.fmt
        if self._embed_fmt is HostFormat.BF16:
            self._embed = np.asarray(emb.weight.view(mx.uint16))
            self._embed_scales = None
        else:
            self._embed = np.asarray(emb.weight)
            self._embed_scales = np.asarray(emb.scales)
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
    def of(cls, model: nn.Module, storage: PagedKVStorage) -> HostDecoder | None:
        """A decoder for `model`, or None when it is off or the model is not one it runs."""
        if not enabled() or unsupported(model, storage) is not None:
            return None
        return cls(model, storage)

    @staticmethod
    def runs(layout: object) -> bool:
        """Whether this step is one it runs: packed, every row one decoded token."""
        return (
            isinstance(layout, PackedLayout)
            and len(layout.segments) == 1
            and layout.segments[0].kind is SegmentKind.ROWS
        )

    # -- the step ------------------------------------------------------------------------------
    def forward(self, layout: PackedLayout, rows: list[int] | None) -> mx.array:
        """Logits [len(rows), V] of the step's sequences `rows` (None: all), as an evaluated
        MLX array; the step's keys and values written to the pool (and the dense copy)."""
        storage = self.storage
        mx.eval(storage.keys, storage.values, layout.tokens, layout.offsets, layout.write_rows)
        seg = layout.segments[0]
        tokens = np.asarray(layout.tokens).reshape(-1)
        b = tokens.shape[0]
        x = self._embedding(tokens)  # [B, hidden] float32
        cos, sin = self._rope_table(np.asarray(layout.offsets))
        kv = _StepKV(storage, seg, np.asarray(layout.write_rows))
        hq, h, d = self.n_heads, self.n_kv, self.head_dim
        q_end, k_end = hq * d, (hq + h) * d
        for i, blk in enumerate(self.blocks):
            hn = _rms_norm(x, blk.ln1, self.eps)
            qkv = blk.qkv.host(hn)
            q = qkv[:, :q_end].reshape(b, hq, d)
            k = qkv[:, q_end:k_end].reshape(b, h, d)
            v = qkv[:, k_end:].reshape(b, h, d)
            q = self._rotate(q, cos, sin) * self.scale
            k = self._rotate(k, cos, sin)
            o = kv.attend(i, q, np.ascontiguousarray(k), np.ascontiguousarray(v))
            x += blk.o.host(o.reshape(b, hq * d))
            hn = _rms_norm(x, blk.ln2, self.eps)
            gu = blk.gate_up.host(hn)
            half = gu.shape[1] // 2
            x += blk.down.host(_swiglu(gu[:, :half], gu[:, half:]))
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
        if self._embed_scales is None:  # bf16 bits -> float32: the high half of the word
            return (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return rows.astype(np.float32) * self._embed_scales[tokens][:, None]

    def _rope_table(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [B, 1, dims / 2] of each row's position (as elementwise.rope_table)."""
        r = self.rope
        half = r.dims // 2
        inv = np.exp(
            np.arange(0, -half, -1, dtype=np.float32) * np.float32(math.log(r.base) / half)
        )
        theta = (positions.astype(np.float32) * np.float32(r.scale))[:, None] * inv
        return np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]

    def _rotate(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x [B, heads, D] rotated by its row's position (nn.RoPE's pairs), a new array."""
        dims = self.rope.dims
        out = np.empty(x.shape, np.float32)
        if self.rope.traditional:  # pairs (2i, 2i + 1)
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
            o1, o2 = out[..., 0:dims:2], out[..., 1:dims:2]
        else:  # pairs (i, i + dims / 2)
            half = dims // 2
            x1, x2 = x[..., :half], x[..., half:dims]
            o1, o2 = out[..., :half], out[..., half:dims]
        np.multiply(x1, cos, out=o1)
        o1 -= x2 * sin
        np.multiply(x1, sin, out=o2)
        o2 += x2 * cos
        if dims < x.shape[-1]:
            out[..., dims:] = x[..., dims:]
        return out


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """mx.fast.rms_norm in float32: x / sqrt(mean(x^2) + eps) * weight."""
    ms = np.einsum("ij,ij->i", x, x) / np.float32(x.shape[1])
    r = np.float32(1.0) / np.sqrt(ms + eps)
    out = x * r[:, None]
    out *= weight
    return out


def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up = gate * up / (1 + exp(-gate)), float32."""
    e = np.negative(gate)
    np.exp(e, out=e)
    e += np.float32(1.0)
    out = gate * up
    out /= e
    return out


class _StepKV:
    """One host step's keys and values: the new rows into the pool (and the decodes' dense
    copy, when the step has its plan), the keys each row attends to, and its attention. The
    pool's and the copy's arrays are MLX's, evaluated; they are written through numpy views
    of their buffers, as the MLX path's in-place scatters write them."""

    def __init__(self, storage: PagedKVStorage, seg: Segment, write_rows: np.ndarray) -> None:
        self.storage = storage
        self.plan = seg.dense
        self.run = storage.block_size * storage.head_dim
        self.write_rows = write_rows  # the pool row of each new key, token-major then head
        plan = self.plan
        self.bias = np.asarray(plan.bias if plan is not None else seg.bias)
        self.slot_rows = None if plan is None or plan.slot_rows is None else np.asarray(
            plan.slot_rows)  # fmt: skip
        self.row_slots = None if plan is None or plan.row_slots is None else np.asarray(
            plan.row_slots)  # fmt: skip
        if plan is not None:
            self.plan_rows = np.asarray(plan.write_rows)
            self.join = None if plan.join_rows is None else (
                np.asarray(plan.join_rows), np.asarray(plan.join_src))  # fmt: skip
            self.rebuild = None if plan.rebuild_runs is None else np.asarray(
                plan.rebuild_runs).reshape(-1)  # fmt: skip
            self.prefix_runs = None if plan.prefix_runs is None else np.asarray(plan.prefix_runs)
        else:
            self.gather = np.asarray(seg.gather_runs)
            self.prefix_runs = None if seg.prefix_runs is None else np.asarray(seg.prefix_runs)

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """q [B, Hq, D] (scaled, rotated), k, v [B, H, D] (rotated keys): writes k, v and
        returns the attention output [B, Hq, D]."""
        s = self.storage
        b, h, d = k.shape
        kpool, vpool = _view(s.keys[layer]), _view(s.values[layer])
        kpool[self.write_rows] = k.reshape(b * h, d)
        vpool[self.write_rows] = v.reshape(b * h, d)
        prefix = None
        if self.plan is not None:
            keys, values, prefix = self._dense(layer, kpool, vpool, k, v)
            if self.slot_rows is not None:
                q = q[self.slot_rows]
        else:
            kr, vr = kpool.reshape(-1, self.run), vpool.reshape(-1, self.run)
            keys = kr[self.gather].reshape(b, h, -1, d)
            values = vr[self.gather].reshape(b, h, -1, d)
            if self.prefix_runs is not None:
                prefix = (kr[self.prefix_runs].reshape(h, -1, d),
                          vr[self.prefix_runs].reshape(h, -1, d))  # fmt: skip
        n = q.shape[0]
        out = host_attention.decode_attention(q.reshape(n, h, q.shape[1] // h, d), keys, values,
                                              self.bias, prefix).reshape(n, -1, d)  # fmt: skip
        if self.row_slots is not None:
            out = out[self.row_slots]
        return out

    def _dense(self, layer: int, kpool: np.ndarray, vpool: np.ndarray, k: np.ndarray,
               v: np.ndarray) -> tuple:  # fmt: skip
        """DecodePlan.fetch in numpy: the copy's keys and values [S, H, L, D] with the new
        rows in, and the shared prefix's [H, P, D] (or None)."""
        plan = self.plan
        kv = plan.owner
        d = kpool.shape[-1]
        out = []
        for pool, new, arrays in ((kpool, k, kv.keys), (vpool, v, kv.values)):
            if self.rebuild is not None:  # the pool already holds the step's new rows
                buf = mx.zeros((self.rebuild.shape[0] * self.run // d, d), mx.float32)
                mx.eval(buf)
                np.take(pool.reshape(-1, self.run), self.rebuild, axis=0,
                        out=_view(buf).reshape(-1, self.run))  # fmt: skip
                arrays[layer] = buf
                arr = _view(buf)
            else:
                arr = _view(arrays[layer])
                if self.join is not None:
                    arr[self.join[0]] = pool[self.join[1]]
                arr[self.plan_rows] = new.reshape(-1, d)
            out.append(arr.reshape(plan.slots, kv.n_kv_heads, plan.capacity, d))
        if self.prefix_runs is not None:
            h = kv.n_kv_heads
            kp = kpool.reshape(-1, self.run)[self.prefix_runs].reshape(h, -1, d)
            vp = vpool.reshape(-1, self.run)[self.prefix_runs].reshape(h, -1, d)
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
