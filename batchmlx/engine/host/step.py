"""Packed steps of a model in a host weight format, run on the host alone, composed from what
its family's blocks differ in (engine/host/family.py).

On MLX's CPU backend a host-format step (engine/host/linear.py) hands every GEMM's input to
the host through an evaluation barrier: 121 a step at 135M, ~350 us each, 42 ms of a width-8
decode step's 81 (measured 2026-12-02), and the norms, RoPE and SwiGLU between them run in
MLX's slow CPU elementwise kernels. Here a packed step (decodes, prompt chunks, or both) runs
as numpy and oneDNN calls over the very same packed weights and paged KV pool, decode rows
and prompt chunks (each query a row of the kernel) attending straight from the pool in the
paged kernel (paged_attention.py; where it cannot run, the decodes' dense copy, kv/decode.py,
and host_attention's tiles for prompt chunks), the norms
(each with the residual add before it), RoPE and gated MLP activations in our elementwise
kernel (ops.py; numpy where it cannot run), and only the logits go back to MLX, in a buffer MLX
owns. One block is written once: its norms
before or after each sublayer, q/k norms, RoPE per layer (or none), sliding windows, GeGLU or
SwiGLU or a mixture of experts (engine/host/experts.py), and the embedding, residual and logit
factors are the Family's parts, so llama, qwen2/3, phi3, gemma2/3, granite, olmo2, smollm3,
qwen3_moe and olmoe share it. Models no Family describes keep the MLX path (said once in the
log); both read and write the same KV, so the two paths can take turns on one sequence.

The arithmetic is the MLX path's: float32 activations, GEMM inputs rounded to bf16 (or
quantized per token for int8, or as they are for float32) exactly as host_linear does,
float32 norms, RoPE and softmax, keys and values stored as the pool holds them (float16 in
the int8 and bf16 formats: `pool_dtype`, which the MLX path reads too); only the order of
float32 sums differs (logits within ~1e-5 of the MLX path's, greedy tokens equal:
tests/engine/test_host_step.py; each family against mlx-lm's own forward:
tests/engine/test_host_families.py).
BATCHMLX_HOST_STEPS=0 turns it off (HostSettings.host_steps, of the HostBackend the model's host
layers were built with: engine/host/backend.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host import experts as host_experts
from batchmlx.engine.host import ops, paged_attention
from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.elementwise import geglu_halves, softcap, swiglu_halves
from batchmlx.engine.host.family import CODE, Activation, Family, QKNorm, describe, norm_weight
from batchmlx.engine.host.linear import (
    HostEmbedding,
    HostExperts,
    HostFormat,
    HostLinear,
    SharedGemm,
)
from batchmlx.engine.host.rope import HostRope, RopeTables
from batchmlx.engine.host.step_kv import StepKV
from batchmlx.engine.kv.paged import PackedLayout, PagedKVStorage

log = logging.getLogger("batchmlx.engine")

# mlx-lm modules whose models the host step composes (engine/host/family.py's CODE)
ARCHITECTURES = tuple(CODE)

__all__ = ["ARCHITECTURES", "HostRope", "HostStep", "backend_of", "covers", "pool_dtype",
           "unsupported"]  # fmt: skip


def backend_of(model: nn.Module) -> HostBackend:
    """The HostBackend `model`'s host layers were built with (else the process's)."""
    gemm = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "_gemm", None)
    return gemm.backend if isinstance(gemm, SharedGemm) else current()


@dataclass(frozen=True, slots=True)
class HostNorm:
    """An RMSNorm on the host: its float32 weight (gemma's 1 + w already added) and eps; in
    our kernel (ops.py) where it runs and x is rows, else numpy."""

    weight: np.ndarray
    eps: np.float32
    address: int  # the weight's, for the kernel (found once: ~2 us a lookup)

    @classmethod
    def of(cls, norm: nn.Module | None, offset: float) -> HostNorm | None:
        if norm is None:
            return None
        w = np.ascontiguousarray(norm_weight(norm, offset), np.float32)
        return cls(w, np.float32(norm.eps), w.ctypes.data)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if ops.available() and ops.rows_of(x):
            out = np.empty(x.shape, np.float32)
            ops.rms_norm(x, self.address, float(self.eps), out)
            return out
        return _rms_norm(x, self.weight, self.eps)

    def add_then(self, x: np.ndarray, r: np.ndarray) -> np.ndarray:
        """x += r (in place), then the norm of x: one pass in the kernel."""
        if ops.available() and ops.rows_of(x) and ops.rows_of(r):
            out = np.empty(x.shape, np.float32)
            ops.rms_norm(x, self.address, float(self.eps), out, r)
            return out
        x += r
        return self(x)


@dataclass(frozen=True, slots=True)
class _Block:
    """One transformer block's host pieces (None: the family has no such part)."""

    pre_attn: HostNorm | None
    post_attn: HostNorm | None
    pre_mlp: HostNorm | None
    post_mlp: HostNorm | None
    q_norm: HostNorm | None
    k_norm: HostNorm | None
    qkv: SharedGemm  # q, k and v in one GEMM (three layers sharing it, or phi3's one)
    o: SharedGemm
    gate_up: SharedGemm | None  # gate and up in one GEMM (None: a mixture of experts)
    down: SharedGemm | None
    router: SharedGemm | None  # a mixture of experts' router and experts (else None)
    experts: HostExperts | None
    rope: int | None  # index into HostStep.ropes; None: no RoPE (smollm3's NoPE layers)
    window: int | None  # sliding window of this layer


def _gemm(layer: object, members: int) -> SharedGemm | None:
    """The SharedGemm behind a HostLinear that reads its input with `members - 1` siblings."""
    if not isinstance(layer, HostLinear):
        return None
    g = layer._gemm
    return g if len(g.splits) == members else None


def _fused(owner: nn.Module, names: tuple[str, ...]) -> SharedGemm | None:
    """The one GEMM behind the layers `names` of `owner` (each a reader of it), or None."""
    gemms = [_gemm(getattr(owner, n, None), len(names)) for n in names]
    first = gemms[0]
    return first if first is not None and all(g is first for g in gemms) else None


def unsupported(model: nn.Module, storage: PagedKVStorage) -> str | None:
    """Why `model` cannot run host steps over `storage` (None: it can)."""
    fam = describe(model)
    if isinstance(fam, str):
        return fam
    return _host_layers_missing(model, fam, storage)


def covers(model: nn.Module) -> Family | None:
    """The Family the host step runs `model` with (host steps on, every layer in a host
    format, so its KV float32), else None. The engine skips its paged probe for such a model:
    each family is tested paged on the host against mlx-lm's own forward
    (tests/engine/test_host_families.py)."""
    if not backend_of(model).settings.host_steps:
        return None
    fam = describe(model)
    if isinstance(fam, str) or _host_layers_missing(model, fam, None) is not None:
        return None
    return fam


# host formats whose KV pool holds float16 (where the paged kernel reads it): half the bytes
# every decode row reads and the pool holds; the keys and values are float32 before, widened
# exactly after (llama.cpp's default KV cache is float16 too). float32 keeps a float32 pool.
HALF_POOL_FORMATS = (HostFormat.INT8, HostFormat.BF16, HostFormat.W8)


def pool_dtype(model: nn.Module) -> mx.Dtype | None:
    """The KV pool's dtype for host steps of `model`: float16 in HALF_POOL_FORMATS where the
    paged decode kernel runs for its shape; None: the model's own (float32 for host steps)."""
    fam = covers(model)
    if fam is None or not paged_attention.takes(fam.head_dim, fam.n_heads // fam.n_kv_heads):
        return None
    gemm = getattr(model.model.embed_tokens, "_gemm", None)
    return mx.float16 if getattr(gemm, "fmt", None) in HALF_POOL_FORMATS else None


def _host_layers_missing(
    model: nn.Module, fam: Family, storage: PagedKVStorage | None
) -> str | None:
    inner = model.model
    if storage is not None and storage.dtype not in (mx.float32, mx.float16):
        return f"KV stored as {storage.dtype}"
    if not isinstance(getattr(inner, "embed_tokens", None), HostEmbedding):
        return "embedding not in a host format"
    head = getattr(model, "lm_head", None)
    if head is not None and _gemm(head, 1) is None:
        return "lm_head not in a host format"
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if _fused(attn, fam.qkv) is None:
            return "q, k, v not one host GEMM"
        if i in fam.expert_layers:
            if _gemm(mlp.gate, 1) is None or not isinstance(mlp.switch_mlp, HostExperts):
                return "router or experts not in a host format"
            if _gemm(attn.o_proj, 1) is None:
                return "o_proj not a host GEMM"
            continue
        if _fused(mlp, fam.gate_up) is None:
            return "gate and up not one host GEMM"
        if _gemm(attn.o_proj, 1) is None or _gemm(mlp.down_proj, 1) is None:
            return "o_proj or down_proj not a host GEMM"
    return None


class HostStep:
    """Runs the packed steps of a supported model on the host (see the module doc)."""

    def __init__(self, model: nn.Module, storage: PagedKVStorage,
                 backend: HostBackend | None = None,
                 family: Family | None = None) -> None:  # fmt: skip
        inner = model.model
        self.backend = backend_of(model) if backend is None else backend
        if family is None:
            described = describe(model)
            assert not isinstance(described, str), described
            family = described
        self.family = fam = family
        self.storage = storage
        self.n_heads, self.n_kv, self.head_dim = fam.n_heads, fam.n_kv_heads, storage.head_dim
        self.scale = np.float32(fam.scale)
        self._mlp = geglu_halves if fam.activation is Activation.GELU_TANH else swiglu_halves
        # the distinct ropes of its layers: a step's tables made once for each
        self.ropes: list[HostRope] = []
        keys: dict[tuple, int] = {}
        for spec in fam.layers:
            if spec.rope is not None and spec.rope.key not in keys:
                keys[spec.rope.key] = len(self.ropes)
                self.ropes.append(spec.rope)
        self.final_norm = HostNorm.of(inner.norm, fam.norm_offset)
        self._embed: HostEmbedding = inner.embed_tokens
        head = getattr(model, "lm_head", None)
        self.head: SharedGemm = self._embed._gemm if head is None else head._gemm
        self.blocks = [self._block(layer, spec.rope, spec.window, keys, i in fam.expert_layers)
                       for i, (layer, spec) in enumerate(zip(inner.layers, fam.layers,
                                                             strict=True))]  # fmt: skip
        self.steps = 0  # steps run here (tests and benchmarks read it)

    def _block(self, layer: nn.Module, rope: HostRope | None, window: int | None,
               keys: dict[tuple, int], experts: bool) -> _Block:  # fmt: skip
        fam = self.family
        attn, mlp, off = layer.self_attn, layer.mlp, fam.norm_offset

        def norm(name: str | None) -> HostNorm | None:
            return None if name is None else HostNorm.of(getattr(layer, name), off)

        qk = fam.qk_norm is not QKNorm.NONE
        return _Block(
            pre_attn=norm(fam.norms.pre_attn), post_attn=norm(fam.norms.post_attn),
            pre_mlp=norm(fam.norms.pre_mlp), post_mlp=norm(fam.norms.post_mlp),
            q_norm=HostNorm.of(attn.q_norm, off) if qk else None,
            k_norm=HostNorm.of(attn.k_norm, off) if qk else None,
            qkv=getattr(attn, fam.qkv[0])._gemm, o=attn.o_proj._gemm,
            gate_up=None if experts else getattr(mlp, fam.gate_up[0])._gemm,
            down=None if experts else mlp.down_proj._gemm,
            router=mlp.gate._gemm if experts else None,
            experts=mlp.switch_mlp if experts else None,
            rope=None if rope is None else keys[rope.key], window=window,
        )  # fmt: skip

    @classmethod
    def of(cls, model: nn.Module, storage: PagedKVStorage) -> HostStep | None:
        """Host steps for `model`, or None when they are off or the model is not one they run."""
        backend = backend_of(model)
        if not backend.settings.host_steps:
            return None
        fam = describe(model)
        why = fam if isinstance(fam, str) else _host_layers_missing(model, fam, storage)
        if why is not None:
            host_layers = any(isinstance(m, HostLinear) for _, m in model.named_modules())
            if host_layers:  # a host format whose steps stay in MLX: say why, once a load
                log.info("steps run in MLX, not on the host alone: %s", why)
            return None
        assert not isinstance(fam, str)
        return cls(model, storage, backend, fam)

    @property
    def attends_from_pool(self) -> bool:
        """Whether its decode rows attend straight from the paged pool (the paged kernel runs
        here for this shape): then the runner keeps no dense copy of the decodes' KV."""
        return paged_attention.takes(self.head_dim, self.n_heads // self.n_kv)

    @staticmethod
    def runs(layout: object) -> bool:
        """Whether this step is one it runs: a packed one (every segment kind)."""
        return isinstance(layout, PackedLayout)

    # -- the step ------------------------------------------------------------------------------
    def forward(self, layout: PackedLayout, rows: list[int] | None) -> mx.array:
        """Logits [len(rows), V] of the step's sequences `rows` (None: all), as an evaluated
        MLX array; the step's keys and values written to the pool (and the dense copy)."""
        storage, fam = self.storage, self.family
        mx.eval(storage.keys, storage.values, layout.tokens, layout.offsets, layout.write_rows)
        tokens = np.asarray(layout.tokens).reshape(-1)
        t = tokens.shape[0]
        x = self._embedding(tokens)  # [T, hidden] float32
        if fam.embed_scale is not None:
            x *= np.float32(fam.embed_scale)
        offsets = np.asarray(layout.offsets)
        tables = [r.tables(offsets) for r in self.ropes]
        kv = StepKV(storage, layout, self.backend)
        hq, h, d = self.n_heads, self.n_kv, self.head_dim
        pending = None  # a sublayer's output not yet added to x: added in its next norm's pass
        for i, blk in enumerate(self.blocks):
            qkv = blk.qkv.host(_residual(x, pending, blk.pre_attn))
            q, k = self._queries_keys(qkv, blk, tables)
            v = qkv[:, (hq + h) * d :].reshape(t, h, d)
            o = kv.attend(i, q, k, np.ascontiguousarray(v), blk.window, fam.attn_softcap)
            pending = self._sublayer(blk.o.host(o.reshape(t, hq * d)), blk.post_attn)
            pending = self._sublayer(self._ffn(_residual(x, pending, blk.pre_mlp), blk),
                                     blk.post_mlp)  # fmt: skip
        if pending is not None:
            x += pending
        last = np.asarray(layout.last_index)
        if rows is not None:
            last = last[np.asarray(rows, dtype=np.int64)]
        hn = np.ascontiguousarray(x[last])
        if self.final_norm is not None:
            hn = self.final_norm(hn)
        logits = mx.zeros((hn.shape[0], self.head._w.n), mx.float32)
        mx.eval(logits)
        out = np.asarray(logits)
        self.head.host(hn, out)  # into MLX's buffer: no copy back
        if fam.logit_divisor is not None:
            out /= np.float32(fam.logit_divisor)
        if fam.final_softcap is not None:
            softcap(out, fam.final_softcap)
        self.steps += 1
        return logits

    def _queries_keys(
        self, qkv: np.ndarray, blk: _Block, tables: list[RopeTables]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The block's queries [T, Hq, D] (normed, rotated, scaled) and keys [T, H, D] (normed,
        rotated) from its qkv GEMM's rows. q and k stay adjacent, so RoPE rotates both in one
        pass."""
        t = qkv.shape[0]
        hq, h, d = self.n_heads, self.n_kv, self.head_dim
        qk = qkv[:, : (hq + h) * d].reshape(t, hq + h, d)  # a view of the GEMM's rows
        if blk.q_norm is not None and blk.k_norm is not None:
            normed = np.empty((t, hq + h, d), np.float32)
            if self.family.qk_norm is QKNorm.HEAD:  # each head over its own head_dim
                normed[:, :hq] = blk.q_norm(qk[:, :hq])
                normed[:, hq:] = blk.k_norm(qk[:, hq:])
            else:  # olmo2: q over all query heads at once, k over all KV heads
                normed[:, :hq] = blk.q_norm(qkv[:, : hq * d]).reshape(t, hq, d)
                normed[:, hq:] = blk.k_norm(qkv[:, hq * d : (hq + h) * d]).reshape(t, h, d)
            qk = normed
        if blk.rope is not None:  # rotated and the queries scaled into a new array
            rows = qk.reshape(t, (hq + h) * d)  # (a view: the GEMM's rows, or the normed heads)
            qk = self.ropes[blk.rope].rotate_scaled(rows, tables[blk.rope], hq, self.scale)
        else:
            if blk.q_norm is None:
                qk = qk.copy()  # (the scaling below must not write the GEMM's rows)
            qk[:, :hq] *= self.scale
        return qk[:, :hq], qk[:, hq:]

    def _ffn(self, h: np.ndarray, blk: _Block) -> np.ndarray:
        """The block's MLP of h [T, hidden]: its gated MLP, or its mixture of experts (each
        token's experts from its own router row, one GEMM pair per chosen expert)."""
        if blk.experts is None:
            assert blk.gate_up is not None and blk.down is not None
            return blk.down.host(self._mlp(blk.gate_up.host(h), backend=self.backend))
        routing = self.family.routing
        assert blk.router is not None and routing is not None
        routed = host_experts.route(blk.router.host(h), routing.top_k, routing.norm_topk_prob)
        outs = host_experts.expert_outputs(
            h, routed.experts, blk.experts.gemms(), lambda gu: self._mlp(gu, backend=self.backend)
        )
        return host_experts.combine(outs, routed.weights)

    def _sublayer(self, r: np.ndarray, norm: HostNorm | None) -> np.ndarray:
        """A sublayer's output r as it is added to the residual: normed first where the family
        norms after the sublayer (gemma, olmo2), times its residual factor (granite)."""
        if norm is not None:
            r = norm(r)
        if self.family.residual_scale is not None:
            r *= np.float32(self.family.residual_scale)
        return r

    def _embedding(self, tokens: np.ndarray) -> np.ndarray:
        return self._embed.lookup(tokens)


def _residual(x: np.ndarray, pending: np.ndarray | None, norm: HostNorm | None) -> np.ndarray:
    """x += pending (a sublayer's output, None: nothing yet), then a sublayer's input: x
    normed by `norm`, or x itself."""
    if pending is None:
        return x if norm is None else norm(x)
    if norm is None:
        x += pending
        return x
    return norm.add_then(x, pending)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """mx.fast.rms_norm in float32 over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    ms = np.einsum("...j,...j->...", x, x) / np.float32(x.shape[-1])
    r = np.float32(1.0) / np.sqrt(ms + eps)
    out = x * r[..., None]
    out *= weight
    return out
