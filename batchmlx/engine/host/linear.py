"""Weights that stay small on MLX's CPU backend: every linear layer and the embedding in bf16
or int8, their GEMMs computed on the host by oneDNN (onednn.py), activations float32.

- **bfloat16** (`--dtype bfloat16`, and `auto` on a CPU without AVX-512 VNNI): weights and a
  layer's input rounded to bf16 (in MLX, in the evaluation before), products summed in float32
  (AVX-512 BF16 `vdpbf16ps`). Logits within ~1.5% of float32's (of the largest) on the default
  model; greedy text follows float32's.
- **float32** (`--dtype auto` on a CPU whose oneDNN has no bf16 matmul: oneDNN 3.2's bf16
  kernels need AVX-512, so an AVX2-only CPU gets this): weights and products float32, as
  MLX's float32 path computes them but for the order of the sums, on numpy's own BLAS (on a
  Zen 3 host 2.6x oneDNN's float32 at decode widths, 2026-12-02), so that the host steps
  (engine/host/step.py) run there too.
- **int8** (`--dtype int8`, and `auto` on AVX-512 VNNI): weights int8 in groups of 32 along K,
  one float32 scale per (output channel, group) (symmetric, w ~= q * s, |q| <= 127); a layer's
  input is quantized per (token, group) on the fly and each group's exact int32 product rescaled
  and summed in group order (q8.py, our own VNNI/AMX kernel): as Q8_0 computes, batch-invariant
  by construction; the embedding and the LM head 8-bit weights against bf16 inputs (head8.py;
  bf16 where that cannot run). Without AVX-512 VNNI or for a shape not a multiple of 16,
  oneDNN's s8 GEMM with a scale per output channel and per token (logits moved by ~15-20%).
- **q4** (`--dtype q4`): a 4-bit GGUF's layers (Q4_0, Q4_1, Q4_K) keep the file's 4 bits in
  memory and GEMM (q4.py: int8 activations); the other layers int8's.

Layers that read the same input (q, k and v; gate and up) share one GEMM over their
concatenated weights: the first call computes all of them and the others take their slice
(the input is the very same MLX array, so identity tells), written straight into a buffer MLX
owns. These formats are for MLX's CPU backend only: on Metal or CUDA, where quantized MLX
kernels are the fast path, the evaluation barrier per GEMM would cost more than it saves.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host import experts as host_experts
from batchmlx.engine.host import head8, numpy_blas, q4, q8, stored
from batchmlx.engine.host.backend import HostBackend, current
from batchmlx.engine.host.elementwise import swiglu_halves
from batchmlx.engine.host.memory import buffers_reused
from batchmlx.engine.host.onednn import DataType, Packed, quantize_rows
from batchmlx.engine.host.packed_cache import PackedCache
from batchmlx.engine.host.stored import Dequantized, eight_bit, float_weight, four_bit, joined_bias


class HostFormat(enum.Enum):
    """A weight format computed on the host; the value is its `--dtype` name."""

    BF16 = "bfloat16"
    INT8 = "int8"
    F32 = "float32"
    Q4 = "q4"  # a 4-bit GGUF's layers as they are; the rest as INT8
    # not a --dtype: the LM head and embedding of INT8 (`head_format`), 8-bit weights against
    # bf16 activations (head8.py)
    W8 = "w8"

    @property
    def data_type(self) -> DataType:
        """oneDNN's type for the weights (and the GEMM's input)."""
        return {HostFormat.BF16: DataType.BF16, HostFormat.INT8: DataType.S8,
                HostFormat.F32: DataType.F32, HostFormat.Q4: DataType.S8,
                HostFormat.W8: DataType.S8}[self]  # fmt: skip

    @property
    def scaled(self) -> bool:
        """Per-output-channel scales (int8)."""
        return self is HostFormat.INT8


def runs_here(fmt: HostFormat, backend: HostBackend | None = None) -> bool:
    """Whether `fmt`'s GEMMs run on this machine: float32 always (numpy's BLAS); bf16 and int8
    where oneDNN loads and has their matmul for this CPU (bf16 needs AVX-512 in oneDNN 3.2)."""
    if fmt is HostFormat.F32:
        return True
    backend = backend or current()
    if fmt is HostFormat.Q4:  # its other layers are int8's
        return q4.available() and runs_here(HostFormat.INT8, backend)
    if fmt is HostFormat.W8:
        return head8.available()
    if fmt is HostFormat.INT8 and q8.available() and backend.onednn_available():
        return True
    return backend.onednn_available() and backend.onednn().supports(
        fmt.data_type, scaled=fmt.scaled
    )


# Sibling layers that read the same input, fused into one GEMM (llama, qwen, mistral, ...)
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True, eq=False)
class HostWeights:
    """One GEMM's weights [N, K] in a host format: bf16 (as MLX bfloat16) or int8 + scales."""

    fmt: HostFormat
    data: mx.array | np.ndarray  # numpy: a read-only view of the mapped cache file (bf16: bits)
    scales: mx.array | None = None  # int8: float32 [N]

    @classmethod
    def of(cls, weight: mx.array, fmt: HostFormat) -> HostWeights:
        if fmt is HostFormat.BF16:
            out = cls(fmt, weight.astype(mx.bfloat16))
        elif fmt is HostFormat.F32:
            out = cls(fmt, weight.astype(mx.float32))
        else:
            q, s = quantize_rows(np.asarray(weight.astype(mx.float32)))
            out = cls(fmt, mx.array(q), mx.array(s.astype(np.float32)))
        mx.eval(out.data, *([] if out.scales is None else [out.scales]))
        return out


class _Local(threading.local):
    x: mx.array | None = None  # the last input (held, so its identity cannot be reused)
    outs: list[mx.array] = []
    taken = 0  # how many of its readers took their slice


class SharedGemm:
    """One GEMM for the layers that read the same input: weights concatenated along N, each
    layer's output a slice of the result. The last input and its outputs are kept per thread,
    so the second and third reader of that input get theirs without another GEMM. The weights
    are held once, in oneDNN's packed layout (`packed`: an MLX array when packed here, so that
    the model's parameters count it; a read-only view of the mapped cache file when read from
    one, host_cache.py); `keep_plain` keeps the row-major ones too (an embedding's lookup)."""

    def __init__(self, weights: list[mx.array | Dequantized], fmt: HostFormat,
                 biases: list[mx.array | None] | None = None, *,
                 keep_plain: bool = False, cache: PackedCache | None = None,
                 key: str = "", backend: HostBackend | None = None) -> None:  # fmt: skip
        # q4 where every member is a 4-bit layer it keeps as it is; int8 otherwise
        if fmt is HostFormat.Q4:
            fmt = HostFormat.Q4 if four_bit(weights) else HostFormat.INT8
        if fmt is HostFormat.W8 and not head8.fits(sum(w.shape[0] for w in weights),
                                                   weights[0].shape[1]):  # fmt: skip
            fmt = HostFormat.BF16 if runs_here(HostFormat.BF16) else HostFormat.F32
        self.fmt = fmt
        # oneDNN and the engine's live thread count (backend.py); the host steps take it too
        self.backend = backend or current()
        self.splits: list[tuple[int, int]] = []
        at = 0
        for w in weights:
            self.splits.append((at, at + w.shape[0]))
            at += w.shape[0]
        self._local = _Local()
        self._q8: q8.Q8Weights | None = None  # int8 through our grouped kernel (q8.py)
        self._q4: q4.Q4Weights | None = None  # 4-bit through our grouped kernel (q4.py)
        self._h8: head8.Head8Weights | None = None  # a W8 head (head8.py)
        self._room = cache.room if cache is not None else None  # where packed bytes go
        hit = cache.take(key) if cache is not None else None
        if hit is None or not self._adopt(hit, at, weights[0].shape[1], keep_plain):
            self._pack(weights, biases or [None] * len(weights), keep_plain)
            if cache is not None:
                cache.packed += 1
        if cache is not None:
            cache.keep(key, {"packed": self.packed, "scales": self.scales,
                             "bias": None if self.bias is None else mx.array(self.bias),
                             "plain": None if self.plain is None else self.plain.data})  # fmt: skip

    def _pack(self, lazy: list[mx.array | Dequantized], biases: list[mx.array | None],
              keep_plain: bool) -> None:  # fmt: skip
        fmt = self.fmt
        self._q8 = None
        if fmt is HostFormat.Q4:
            self._pack_q4(lazy, biases)
            return
        if fmt is HostFormat.W8:
            self._pack_w8(lazy, biases)
            return
        self.bias = joined_bias(lazy, biases)
        weights = [w.array() if isinstance(w, Dequantized) else w for w in lazy]
        shape = (sum(w.shape[0] for w in weights), weights[0].shape[1])
        if self._grouped(*shape):
            # numpy's bytes, as a cached layer's are (a mapped file's), and each part packed
            # as it lies: MLX's concatenation of a 1.7B model's bf16 q, k, v (gate, up) took ~8
            # s of a first start (their reads ~2), and MLX's copy of the bytes after ~1
            into = self._room(q8.Q8Weights.nbytes(*shape)) if self._room else None
            self._q8 = q8.Q8Weights.pack([stored.table(w) for w in weights], into=into,
                                         threads=self.backend.threads.or_cpus())  # fmt: skip
            self.packed = self._q8.buffer
            self._w = Packed(None, self._q8.buffer, *shape, fmt.data_type, False)
        full = stored.joined(weights) if self._q8 is None or keep_plain else None
        plain = None if full is None else HostWeights.of(full, fmt)
        if self._q8 is not None:
            pass  # packed above; `plain` (an embedding's rows) only for lookups
        elif fmt is HostFormat.F32 and not self._onednn_f32():
            # numpy's BLAS reads the rows as they are: nothing to pack
            assert plain is not None
            self.packed = plain.data
            self._w = Packed(None, np.asarray(self.packed), *shape, fmt.data_type, False)
        else:
            assert plain is not None
            rows = np.asarray(plain.data.view(mx.uint16) if fmt is HostFormat.BF16 else plain.data)
            packed = self.backend.onednn().pack(rows, fmt.data_type, scaled=fmt.scaled)
            self.packed = mx.array(packed.buffer)  # MLX owns the bytes from here on
            self._w = replace(packed, buffer=np.asarray(self.packed))
        self.scales = None if plain is None else plain.scales
        self._s = None if self.scales is None or self._q8 is not None else np.asarray(self.scales)
        self.plain = plain if keep_plain else None

    def _pack_q4(self, lazy: list[mx.array | Dequantized], biases: list[mx.array | None]) -> None:
        """The 4-bit layers' own values, scales and biases in q4's layout (never dequantized)."""
        grouped = q4.Q4Weights.from_affine([w.parts() for w in lazy if isinstance(w, Dequantized)])
        self.packed = mx.array(grouped.buffer)  # MLX owns the bytes from here on
        self._q4 = replace(grouped, buffer=np.asarray(self.packed))
        self._w = Packed(None, self._q4.buffer, grouped.n, grouped.k, DataType.S8, False)
        self.bias = joined_bias(lazy, biases)
        self.scales, self._s, self.plain = None, None, None

    def _pack_w8(self, lazy: list[mx.array | Dequantized], biases: list[mx.array | None]) -> None:
        """8-bit values and a scale per group of 32: a Q8_0 table's own, else rounded here."""
        grouped = eight_bit(lazy)
        # MLX owns the bytes from here on
        self.packed, self.scales = mx.array(grouped.values), mx.array(grouped.scales)
        self._h8 = replace(grouped, values=np.asarray(self.packed), scales=np.asarray(self.scales))
        self._w = Packed(None, self._h8.values, grouped.n, grouped.k, DataType.S8, False)
        self.bias = joined_bias(lazy, biases)
        self._s, self.plain = None, None

    def _grouped(self, n: int, k: int) -> bool:
        """int8 through the grouped kernel (q8.py): where it runs here and takes this shape."""
        return self.fmt is HostFormat.INT8 and q8.available() and q8.fits(n, k)

    def _onednn_f32(self) -> bool:
        """float32 in oneDNN's brgemm kernels where it has them (AVX-512): their rows are the
        same at every M (batch invariance) and they were faster than numpy's BLAS there (135M
        shapes, 2-core Xeon, 2026-12-06: 29 against 86 ms for the head at M = 64); numpy's
        BLAS elsewhere (2.6x oneDNN's float32 on a Zen 3 host), whose M = 1 product is a GEMV
        that sums in another order."""
        return self.backend.onednn_available() and self.backend.onednn().brgemm(DataType.F32)

    def _adopt(self, hit: dict[str, mx.array | np.ndarray], n: int, k: int,
               keep_plain: bool) -> bool:  # fmt: skip
        """Take a cached layer's arrays (False: they do not fit this shape or library)."""
        fmt = self.fmt
        if fmt is HostFormat.F32:  # nothing packed to adopt: its rows are rebuilt from source
            return False
        if fmt is HostFormat.W8:
            return self._adopt_w8(hit, n, k)
        grouped = self._grouped(n, k) or fmt is HostFormat.Q4
        needs_scales = fmt.scaled and (keep_plain or not grouped)  # grouped: inside `packed`
        if (keep_plain and "plain" not in hit) or (needs_scales and "scales" not in hit):
            return False
        packed = hit["packed"]  # the mapped file's bytes, used where they lie
        buffer = np.asarray(packed)
        if fmt is HostFormat.Q4:
            self._q4 = q4.Q4Weights.adopt(buffer, n, k)
        else:
            self._q8 = q8.Q8Weights.adopt(buffer, n, k) if grouped else None
        kernel = self._q4 or self._q8
        if grouped:
            if kernel is None:
                return False
            w: Packed | None = Packed(None, kernel.buffer, n, k, fmt.data_type, False)
        else:
            w = self.backend.onednn().adopt(buffer, n, k, fmt.data_type, scaled=fmt.scaled)
        if w is None:
            return False
        self.packed, self._w = packed, w
        self.scales = hit.get("scales") if needs_scales else None
        self._s = None if self.scales is None or grouped else np.asarray(self.scales)
        self.bias = np.asarray(hit["bias"]) if "bias" in hit else None
        self.plain = HostWeights(self.fmt, hit["plain"], self.scales) if keep_plain else None
        return True

    def _adopt_w8(self, hit: dict[str, mx.array | np.ndarray], n: int, k: int) -> bool:
        if "scales" not in hit:
            return False
        grouped = head8.Head8Weights.adopt(np.asarray(hit["packed"]), np.asarray(hit["scales"]),
                                           n, k)  # fmt: skip
        if grouped is None:
            return False
        self.packed, self.scales, self._h8 = hit["packed"], hit["scales"], grouped
        self._w = Packed(None, grouped.values, n, k, DataType.S8, False)
        self.bias = np.asarray(hit["bias"]) if "bias" in hit else None
        self._s, self.plain = None, None
        return True

    def output(self, x: mx.array, index: int) -> mx.array:
        if len(self.splits) == 1:
            return self._compute(x)
        st = self._local
        if st.x is not x:
            full = self._compute(x)
            st.x, st.outs, st.taken = x, [full[..., a:b] for a, b in self.splits], 0
        out = st.outs[index]
        st.taken += 1
        if st.taken >= len(self.splits):  # every reader has its slice: hold nothing more
            st.x, st.outs = None, []
        return out

    def _compute(self, x: mx.array) -> mx.array:
        out = mx.zeros((*x.shape[:-1], self._w.n), mx.float32)  # the buffer the result goes into
        if self.fmt in (HostFormat.BF16, HostFormat.W8):
            src = x.astype(mx.bfloat16).view(mx.uint16)  # rounded in MLX, in this evaluation
        else:
            src = x
        mx.eval(src, out)
        # writes into a writable view of MLX's buffer
        self.host(np.asarray(src).reshape(-1, self._w.k), np.asarray(out).reshape(-1, self._w.n))
        return out

    def host(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """out[M, N] = x[M, K] . W^T (+ bias) on numpy arrays: x float32 (bf16: its bits as
        uint16 are taken as they are), out float32 C-contiguous (allocated when None). The
        MLX layers' GEMM and the host steps' (engine/host/step.py)."""
        if out is None:
            out = np.empty((x.shape[0], self._w.n), np.float32)
        if self.fmt is HostFormat.BF16:
            lib = self.backend.onednn()
            bits = x if x.dtype == np.uint16 else lib.to_bf16(as_rows(x))
            lib.matmul(np.ascontiguousarray(bits), self._w, out)
        elif self.fmt is HostFormat.F32 and self._w.md is not None:
            x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self._w.k)
            self.backend.onednn().matmul(x, self._w, out)
        elif self.fmt is HostFormat.F32:
            with numpy_blas.threads(self.backend.threads.or_cpus()):
                np.matmul(np.ascontiguousarray(x, dtype=np.float32), self._w.buffer.T, out=out)
        elif self._h8 is not None:
            b, x = self.backend, x.reshape(-1, self._w.k) if x.dtype == np.uint16 else as_rows(x)
            # on the GEMMs' workers (q8's), else with the attention tiles' idle threads
            head8.matmul(x, self._h8, out, threads=b.threads.or_cpus(), pool=b.pool,
                         runner=q8.pool_runner())  # fmt: skip
        elif self._q4 is not None:
            b = self.backend
            q4.matmul(as_rows(x), self._q4, out, threads=b.threads.or_cpus())
        elif self._q8 is not None:
            b = self.backend
            q8.matmul(as_rows(x), self._q8, out, threads=b.threads.or_cpus())
        else:
            lib = self.backend.onednn()
            q, t = quantize_rows(as_rows(x), lib)
            lib.matmul(q, self._w, out, self._s)
            out *= t[:, None]
        if self.bias is not None:
            out += self.bias
        return out


def as_rows(x: np.ndarray) -> np.ndarray:
    """x as float32 [M, K] whose rows may be strided but whose elements are adjacent."""
    x = np.asarray(x, dtype=np.float32)
    x = x.reshape(-1, x.shape[-1])
    return x if x.strides[-1] == x.itemsize and x.strides[0] > 0 else np.ascontiguousarray(x)


class HostLinear(nn.Module):
    """nn.Linear whose GEMM runs on the host in a host format, alone or as one reader of a
    SharedGemm. The first reader of a shared GEMM holds its weights as parameters (so the
    model's parameters count them once); the others hold only the GEMM."""

    def __init__(self, gemm: SharedGemm, index: int, *, owner: bool) -> None:
        super().__init__()
        self._gemm = gemm
        self._index = index
        if owner:
            self.packed = gemm.packed
            if gemm.scales is not None:
                self.scales = gemm.scales

    def __call__(self, x: mx.array) -> mx.array:
        return self._gemm.output(x, self._index)


class HostEmbedding(nn.Module):
    """nn.Embedding in a host format: a lookup dequantizes its rows in MLX; `as_linear` (a
    tied lm_head) is a host GEMM. Its rows (`weight`) are an MLX array when packed here, or a
    read-only numpy view of the mapped cache file when read from one (bf16: their bits as
    uint16): then only the rows a run looks up are resident, and the table is held once, as
    the packed head's weights beside it (a 135M model's 49,152 x 576 table: 54 MB that were
    copied into MLX's memory at each start, and resident twice, as the file's pages too)."""

    def __init__(self, weight: mx.array | Dequantized, fmt: HostFormat, *,
                 cache: PackedCache | None = None,
                 key: str = "", backend: HostBackend | None = None) -> None:  # fmt: skip
        super().__init__()
        self._gemm = SharedGemm([weight], fmt, keep_plain=True, cache=cache, key=key,
                                backend=backend)  # fmt: skip
        self._h8 = self._gemm._h8  # W8: the lookups read the head's own table (head8.rows)
        if self._h8 is not None:
            self.weight = self._gemm.packed  # [V, D] int8 values, in the kernel's layout
            self.scales = self._gemm.scales
            return
        assert self._gemm.plain is not None
        self.weight = self._gemm.plain.data  # row-major, for the lookup
        if self._gemm.packed is not self.weight:  # (float32: the very same rows)
            self.packed = self._gemm.packed  # for the tied head's GEMM
        if self._gemm.scales is not None:
            self.scales = self._gemm.scales

    def host_rows(self) -> np.ndarray:
        """The rows as numpy, where they lie: bf16 as their bits (uint16), int8, float32."""
        w = self.weight
        if isinstance(w, np.ndarray):
            return w
        return np.asarray(w.view(mx.uint16) if w.dtype == mx.bfloat16 else w)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """float32 [len(ids), D]: the rows `ids` (a host step's embedding)."""
        if self._h8 is not None:
            return head8.rows(self._h8, ids)
        rows = self.host_rows()[ids]
        if self._gemm.fmt is HostFormat.BF16:  # bf16 bits -> float32: the high half of the word
            return (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        scales = self.get("scales")
        if scales is None:
            return rows
        return rows.astype(np.float32) * np.asarray(scales)[ids][:, None]

    def __call__(self, ids: mx.array) -> mx.array:
        if self._h8 is not None:
            return mx.array(head8.rows(self._h8, np.asarray(ids))).reshape(*ids.shape, -1)
        if isinstance(self.weight, np.ndarray):  # mapped: the rows looked up, then as MLX's
            rows = mx.array(self.weight[np.asarray(ids)])
            if self._gemm.fmt is HostFormat.BF16:
                rows = rows.view(mx.bfloat16)
        else:
            rows = self.weight[ids]
        rows = rows.astype(mx.float32)
        scales = self.get("scales")
        return rows if scales is None else rows * scales[ids][..., None]

    def as_linear(self, x: mx.array) -> mx.array:
        return self._gemm.output(x, 0)


class HostExperts(nn.Module):
    """mlx-lm's SwitchGLU (a mixture of experts' SwiGLU MLPs, weights stacked [E, N, K]) in a
    host format: expert e's gate and up one GEMM (`gate_up[e]`), its down another (`down[e]`).
    Called as SwitchGLU is (the MLX path: x [..., D], each token's experts [..., k] -> each
    expert's output [..., k, D]), it computes on the host (experts.py), one GEMM pair per
    expert that any token chose; the host step takes `gemms` and routes there."""

    def __init__(self, glu: nn.Module, fmt: HostFormat, cache: PackedCache | None, where: str,
                 backend: HostBackend) -> None:  # fmt: skip
        super().__init__()
        gate, up, down = (glu[n] for n in ("gate_proj", "up_proj", "down_proj"))

        def layer(ws: list[mx.array], key: str) -> HostLinear:
            gemm = SharedGemm(ws, fmt, cache=cache, key=f"{where}.{key}", backend=backend)
            return HostLinear(gemm, 0, owner=True)

        experts = range(gate["weight"].shape[0])
        self.gate_up = [layer([_expert_weight(gate, e), _expert_weight(up, e)],
                              f"{e}.gate_proj+up_proj") for e in experts]  # fmt: skip
        self.down = [layer([_expert_weight(down, e)], f"{e}.down_proj") for e in experts]
        self._backend = backend
        self._gemms: host_experts.ExpertGemms | None = None

    @staticmethod
    def takes(glu: object) -> bool:
        """Whether `glu` is a SwitchGLU this form computes: SwiGLU, no biases."""
        from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

        parts = ("gate_proj", "up_proj", "down_proj")
        return (type(glu) is SwitchGLU and type(glu.activation) is SwiGLU
                and not any("bias" in glu[n] or glu[n].get("global_scale") is not None
                            for n in parts))  # fmt: skip

    def gemms(self) -> host_experts.ExpertGemms:
        """Each expert's gate-up and down GEMMs, as functions of numpy rows."""
        if self._gemms is None:
            first = self.gate_up[0]._gemm
            # (SharedGemm.host takes uint16 rows as bf16 bits)
            bf16 = first.backend.onednn().to_bf16 if first.fmt is HostFormat.BF16 else None
            # int8: each group of experts' runs in one call of its kernel
            ups, downs = [g._gemm._q8 for g in self.gate_up], [d._gemm._q8 for d in self.down]
            runs = q8.expert_runs(ups, downs, first.backend.threads.or_cpus)
            self._gemms = host_experts.ExpertGemms(
                [g._gemm.host for g in self.gate_up], [d._gemm.host for d in self.down],
                first._w.n, bf16, runs)  # fmt: skip
        return self._gemms

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        x = x.astype(mx.float32)
        mx.eval(x, indices)
        rows = np.asarray(x).reshape(-1, x.shape[-1])
        chosen = np.asarray(indices).reshape(-1, indices.shape[-1]).astype(np.int64)
        out = host_experts.expert_outputs(rows, chosen, self.gemms(), self._act)
        return mx.array(out).reshape(*indices.shape, x.shape[-1])

    def _act(self, gu: np.ndarray) -> np.ndarray:
        return swiglu_halves(gu, backend=self._backend)


def _expert_weight(layer: nn.Module, e: int) -> mx.array | Dequantized:
    """Expert e's weight [N, K] of a SwitchLinear, or of a QuantizedSwitchLinear dequantized
    (an mlx-lm 4-bit model's experts, or a GGUF's: one expert's float weights at a time)."""
    if "scales" not in layer:
        return layer["weight"][e]
    if getattr(layer, "mode", "affine") == "affine" and layer["scales"].dtype == mx.float32:
        return Dequantized(layer, e)
    biases = layer.get("biases")
    return mx.dequantize(layer["weight"][e], layer["scales"][e],
                         None if biases is None else biases[e], group_size=layer.group_size,
                         bits=layer.bits, mode=getattr(layer, "mode", "affine"))  # fmt: skip


# a mixture of experts' router (the `gate` beside a HostExperts) stays float32, as llama.cpp
# keeps it: which experts a token gets should not move with the weights' format
ROUTER = "gate"
_EXPERTS = "switch_mlp"

_CONVERTED = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def _linears(module: nn.Module) -> dict[str, nn.Module]:
    return {name: child for name, child in module.children().items()
            if isinstance(child, (nn.Linear, nn.QuantizedLinear))}  # fmt: skip


def head_format(fmt: HostFormat, backend: HostBackend) -> HostFormat:
    """The embedding's and the LM head's format in a model of `fmt`: int8's is W8 (8-bit
    weights, bf16 activations: head8.py) where it runs; int8's elsewhere and q4's bf16
    (float32 where oneDNN has no bf16 matmul). The head is where 8 bits cost most when its
    activations are 8-bit too: in groups of 32 it moved the next-token distribution by a KL
    divergence of 0.00076 (benchmarks/RESULTS-int8.md), a fifth of llama.cpp's whole Q8_0
    model. Its weights alone in 8 bits (the default model's Q8_0 table as it is) measured
    int8 96.19% / 0.003158 against the bf16 head's 96.02% / 0.003181, but q4 97.00% / 0.002100
    against 96.72% / 0.002064 (a higher KLD): q4 keeps bf16 (RESULTS-fidelity.md)."""
    if fmt not in (HostFormat.INT8, HostFormat.Q4):
        return fmt
    if fmt is HostFormat.INT8 and runs_here(HostFormat.W8, backend):
        return HostFormat.W8
    return HostFormat.BF16 if runs_here(HostFormat.BF16, backend) else HostFormat.F32


def _host_layers(module: nn.Module, fmt: HostFormat, cache: PackedCache | None,
                 where: str, backend: HostBackend) -> dict[str, nn.Module]:  # fmt: skip
    """The host layers replacing `module` (at `where` in the model)'s linear children,
    shared-input siblings fused."""
    linears = _linears(module)
    out: dict[str, nn.Module] = {}
    for names in SHARED_INPUT_GROUPS:
        if all(n in linears for n in names):
            members = [linears[n] for n in names]
            if len({float_weight(m).shape[1] for m in members}) == 1:
                gemm = SharedGemm([float_weight(m) for m in members], fmt,
                                  [m.get("bias") for m in members], cache=cache,
                                  key=f"{where}.{'+'.join(names)}", backend=backend)  # fmt: skip
                for i, n in enumerate(names):
                    out[n] = HostLinear(gemm, i, owner=i == 0)
    experts = module.get(_EXPERTS)
    if HostExperts.takes(experts):
        out[_EXPERTS] = HostExperts(experts, fmt, cache, f"{where}.{_EXPERTS}", backend)
    for n, m in linears.items():
        if n not in out:
            own = head_format(fmt, backend) if n == "lm_head" else fmt
            # (not kept in the packed cache: a float32 layer is always rebuilt from source)
            router = n == ROUTER and _EXPERTS in out
            gemm = SharedGemm([float_weight(m)], HostFormat.F32 if router else own,
                              [m.get("bias")], cache=None if router else cache,
                              key=f"{where}.{n}", backend=backend)  # fmt: skip
            out[n] = HostLinear(gemm, 0, owner=True)
    return out


def to_host_format(model: nn.Module, fmt: HostFormat, cache: PackedCache | None = None,
                   backend: HostBackend | None = None) -> nn.Module:  # fmt: skip
    """Replace every linear layer and embedding of `model` by its host form in `fmt`, one parent
    module at a time (so only one layer's float weights exist at once beside the rest), and
    make the remaining floating parameters (norms) float32. With a `cache`, layers it holds
    are taken from it (their float weights never read) and the others packed into it. Checks
    the library first (OneDNNUnavailable names what to install). `backend`: the HostBackend
    every layer computes with (default: the process's). Mutates and returns."""
    backend = backend or current()
    backend.onednn()
    # parents only: a list holding the linear layers themselves would keep every float
    # weight alive until the end
    parents = [(where, m) for where, m in model.named_modules() if any(
        isinstance(c, _CONVERTED) for c in m.children().values())]  # fmt: skip
    with buffers_reused():
        for where, parent in parents:
            layers = _host_layers(parent, fmt, cache, where, backend)
            for name, child in parent.children().items():
                if isinstance(child, (nn.Embedding, nn.QuantizedEmbedding)):
                    layers[name] = HostEmbedding(float_weight(child), head_format(fmt, backend),
                                                 cache=cache, key=f"{where}.{name}",
                                                 backend=backend)  # fmt: skip
            for name, layer in layers.items():
                setattr(parent, name, layer)
    _norms_to_float32(model)
    return model


def _norms_to_float32(model: nn.Module) -> None:
    def cast(m: nn.Module) -> None:
        if isinstance(m, (HostLinear, HostEmbedding)):
            return
        for key, value in m.items():
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                m[key] = value.astype(mx.float32)

    for _, m in model.named_modules():
        cast(m)
    mx.eval(model.parameters())
    mx.clear_cache()  # the float weights just replaced: give their memory back, not keep it
