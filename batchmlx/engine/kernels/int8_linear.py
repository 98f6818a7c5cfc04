"""int8 weights for the linear layers, computed on the host by oneDNN: `--dtype int8`.

MLX 0.32's CPU kernels for bf16 and quantized weights run at 2.5-6 GFLOP/s, so on a Linux CPU
the only fast MLX path is float32 through a fast BLAS, at 4 bytes a weight. Here every
`nn.Linear` of the model (attention and MLP projections, the lm_head) and the embedding keep
int8 weights with one float32 scale per output channel (symmetric: w ~= q * s, |q| <= 127),
and a layer's input is quantized per token on the fly (x ~= p * t, t = max|x_row| / 127). The
int8 x int8 -> int32 GEMM runs in oneDNN (AVX-512 VNNI / AVX2 kernels chosen at run time by
CPU features, not vendor, so AMD hosts get them too), called through its C API on the layer's
evaluated MLX input, writing straight into a buffer MLX owns, as the host kernels do
(host_attention.py): out = (p . q^T) * t * s (+ bias).

The library is optional: `pip install 'batchmlx[cpu-int8]'` brings the `onednn-cpu-gomp`
wheel (oneDNN 3.2, GNU OpenMP, Linux x86-64). `load_library` finds it under the Python
prefixes (or `BATCHMLX_ONEDNN_LIB`) and says what to install when it is missing. The format
is for MLX's CPU backend only: on Metal or CUDA the evaluation barrier per layer would cost
more than it saves, and quantized MLX kernels are the fast path there.

Measured on a loaded 2-core AMD EPYC (AVX-512 VNNI), one thread, all 211 linear layers of a
SmolLM2-135M step, weights from memory (benchmarks/int8_paths.py): float32 through OpenBLAS
107 ms at 64 rows, 1,398 ms at 1,000; oneDNN int8 33 / 314 ms (40 / 506 with the per-token
quantization in numpy); MKL's `cblas_gemm_s8u8s32` 940 ms at 64 rows (MKL runs slow generic
code on AMD CPUs). The engine (benchmarks/weight_formats.py): 1.6x float32's tok/s at widths
8-128, weights 129 MB instead of 513 MB. Parity: int32 sums are exact, so a row's result does
not depend on its batch; against float32 the logits differ by up to ~20% of the largest logit
and greedy text follows float32's for the first few to all tokens (tests/engine/
test_int8_linear.py states what is tested).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.accel import python_prefixes

LIBRARY_ENV = "BATCHMLX_ONEDNN_LIB"  # an explicit path to libdnnl.so.3*
INSTALL_HINT = (
    "--dtype int8 needs oneDNN: pip install 'batchmlx[cpu-int8]' (Linux x86-64; it installs "
    "the onednn-cpu-gomp wheel, which needs the GNU OpenMP runtime libgomp.so.1)"
)
_LIB_NAMES = ("libdnnl.so.3.2", "libdnnl.so.3*", "libdnnl.so")
_F32, _S8 = 3, 5  # dnnl_data_type_t
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_SCALES = 1, 17, 33, 4096
_p = ctypes.c_void_p
# Primitives kept (one per shape seen); past this many they are all dropped and remade
MAX_PRIMITIVES = 2048


class Int8Unavailable(RuntimeError):
    """`--dtype int8` asked for where it cannot run (no oneDNN, or not MLX's CPU backend)."""


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _p)]


class OneDNN:
    """oneDNN's C API through ctypes: s8 x s8 -> f32 matmuls with per-channel weight scales.
    A primitive per shape (rows, outputs, inputs) is made on first use and kept (layer shapes,
    decode widths and prompt chunk sizes recur); its memory objects are re-pointed at each
    call's buffers."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        lib.dnnl_primitive_execute.argtypes = [_p, _p, ctypes.c_int, _p]
        lib.dnnl_memory_set_data_handle.argtypes = [_p, _p]
        lib.dnnl_stream_wait.argtypes = [_p]
        lib.dnnl_memory_create.argtypes = [_p, _p, _p, _p]
        lib.dnnl_matmul_primitive_desc_create.argtypes = [_p, _p, _p, _p, _p, _p, _p]
        lib.dnnl_primitive_create.argtypes = [_p, _p]
        lib.dnnl_primitive_attr_set_scales_mask.argtypes = [_p, ctypes.c_int, ctypes.c_int]
        lib.dnnl_stream_create.argtypes = [_p, _p, ctypes.c_uint]
        lib.dnnl_primitive_destroy.argtypes = lib.dnnl_memory_destroy.argtypes = [_p]
        self.engine, self.stream = _p(), _p()
        self._ok(lib.dnnl_engine_create(ctypes.byref(self.engine), 1, ctypes.c_size_t(0)))
        self._ok(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, 1))
        self._prims: dict[tuple[int, int], tuple] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _ok(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"oneDNN call failed (status {status})")

    def _md(self, dims: tuple[int, ...], dt: int, strides: tuple[int, ...]) -> _p:
        md = _p()
        d = (ctypes.c_int64 * 12)(*dims)
        s = (ctypes.c_int64 * 12)(*strides)
        self._ok(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(dims), d, dt, s))  # fmt: skip
        return md

    def _primitive(self, m: int, n: int, k: int) -> tuple:
        lib = self.lib
        src = self._md((m, k), _S8, (k, 1))
        wts = self._md((k, n), _S8, (1, k))  # W[N, K] row-major is [K, N] with strides (1, K)
        dst = self._md((m, n), _F32, (n, 1))
        scl = self._md((n,), _F32, (1,))
        attr = _p()
        self._ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)))
        self._ok(lib.dnnl_primitive_attr_set_scales_mask(attr, _ARG_WEIGHTS, 1 << 1))
        pd, prim = _p(), _p()
        self._ok(lib.dnnl_matmul_primitive_desc_create(
            ctypes.byref(pd), self.engine, src, wts, None, dst, attr))  # fmt: skip
        self._ok(lib.dnnl_primitive_create(ctypes.byref(prim), pd))
        mems = []
        for md in (src, wts, dst, scl):
            mem = _p()
            self._ok(lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, None))
            mems.append(mem)
        ids = (_ARG_SRC, _ARG_WEIGHTS, _ARG_DST, _ARG_SCALES | _ARG_WEIGHTS)
        args = (_ExecArg * 4)(*[_ExecArg(a, mm) for a, mm in zip(ids, mems, strict=True)])
        return prim, mems, args

    def _clear(self) -> None:
        for prim, mems, _ in self._prims.values():
            self.lib.dnnl_primitive_destroy(prim)
            for mem in mems:
                self.lib.dnnl_memory_destroy(mem)
        self._prims.clear()

    def matmul(self, x: np.ndarray, w: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
        """out[M, N] = (x[M, K] . w[N, K]^T) * scales[N]; x, w int8, all C-contiguous."""
        m, k = x.shape
        n = w.shape[0]
        key = (m, n, k)  # a primitive depends on the shapes only: buffers are set per call
        with self._lock:
            entry = self._prims.get(key)
            if entry is None:
                if len(self._prims) >= MAX_PRIMITIVES:
                    self._clear()
                entry = self._prims[key] = self._primitive(m, n, k)
            prim, mems, args = entry
            for mem, arr in zip(mems, (x, w, out, scales), strict=True):
                self.lib.dnnl_memory_set_data_handle(mem, arr.ctypes.data)
            self._ok(self.lib.dnnl_primitive_execute(prim, self.stream, 4, args))
            self._ok(self.lib.dnnl_stream_wait(self.stream))


_library: OneDNN | None = None


def library_candidates() -> list[str]:
    """Paths of libdnnl to try, best first: BATCHMLX_ONEDNN_LIB, then <prefix>/lib of this
    Python (where the onednn wheels put it)."""
    found = [os.environ[LIBRARY_ENV]] if os.environ.get(LIBRARY_ENV) else []
    for prefix in python_prefixes():
        for name in _LIB_NAMES:
            found += sorted(glob.glob(str(prefix / "lib" / name)))
    return list(dict.fromkeys(found))


def load_library() -> OneDNN:
    """oneDNN, loaded once; Int8Unavailable (with what to install) when it cannot be."""
    global _library
    if _library is not None:
        return _library
    if mx.default_device().type != mx.DeviceType.cpu:
        raise Int8Unavailable("--dtype int8 runs on MLX's CPU backend only (Linux); on a GPU "
                              "use --dtype auto (quantized MLX kernels)")  # fmt: skip
    # idle OpenMP threads sleep instead of spinning against the numpy and BLAS work between
    # two layers (a value set by the user is kept); read when libgomp starts
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    errors = []
    for path in library_candidates():
        try:
            _library = OneDNN(path)
            return _library
        except (OSError, AttributeError, RuntimeError) as exc:
            errors.append(f"{path}: {exc}")
    detail = f" (tried: {'; '.join(errors)})" if errors else ""
    raise Int8Unavailable(INSTALL_HINT + detail)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: x ~= q * s, s = max|x_row| / 127 (1 for an all-zero row)."""
    amax = np.maximum(x.max(axis=1), -x.min(axis=1))
    s = amax * np.float32(1.0 / 127.0)
    s[s == 0] = 1.0
    t = np.multiply(x, (np.float32(1.0) / s)[:, None])
    np.rint(t, out=t)
    return t.astype(np.int8), s


def quantize_weight(w: mx.array) -> tuple[mx.array, mx.array]:
    """w[N, K] (float) -> int8 q[N, K] and float32 scales[N], w ~= q * scales[:, None]."""
    w = np.asarray(w.astype(mx.float32))
    q, s = quantize_rows(w)
    return mx.array(q), mx.array(s.astype(np.float32))


class _Inputs(threading.local):
    """The last input's quantization, reused by the layers that share it (q, k, v read the
    same normed hidden states; gate and up the same MLP input); one per thread."""

    def __init__(self) -> None:
        self.key: mx.array | None = None
        self.value: tuple[np.ndarray, np.ndarray] | None = None

    def get(self, x: mx.array) -> tuple[np.ndarray, np.ndarray]:
        if self.key is not x or self.value is None:
            flat = np.asarray(x).reshape(-1, x.shape[-1])
            if flat.dtype != np.float32:
                flat = flat.astype(np.float32)
            self.key, self.value = x, quantize_rows(np.ascontiguousarray(flat))
        return self.value


_last_input = _Inputs()


def int8_matmul(x: mx.array, weight: mx.array, scales: mx.array,
                bias: mx.array | None = None) -> mx.array:
    """x[..., K] @ dequantized(weight)^T (+ bias) as float32, computed on the host."""
    lib = load_library()
    n = weight.shape[0]
    out = mx.zeros((*x.shape[:-1], n), mx.float32)  # the buffer the result goes into
    mx.eval(x, out)
    q, t = _last_input.get(x)
    o = np.asarray(out).reshape(-1, n)  # writable view of MLX's buffer
    lib.matmul(q, np.asarray(weight), np.asarray(scales), o)
    o *= t[:, None]
    if bias is not None:
        o += np.asarray(bias.astype(mx.float32))
    return out


class Int8Linear(nn.Module):
    """nn.Linear with int8 weights and per-output-channel scales (see the module note)."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight, self.scales = quantize_weight(weight)
        if bias is not None:
            self.bias = bias.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        return int8_matmul(x, self.weight, self.scales, self.get("bias"))


class Int8Embedding(nn.Module):
    """nn.Embedding with int8 rows: a lookup dequantizes its rows (in MLX); `as_linear` (the
    tied lm_head) is an int8 matmul."""

    def __init__(self, weight: mx.array) -> None:
        super().__init__()
        self.weight, self.scales = quantize_weight(weight)

    def __call__(self, ids: mx.array) -> mx.array:
        return self.weight[ids].astype(mx.float32) * self.scales[ids][..., None]

    def as_linear(self, x: mx.array) -> mx.array:
        return int8_matmul(x, self.weight, self.scales)


def quantize_model(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear and nn.Embedding of a float model by its int8 form. Checks the
    library first (Int8Unavailable names what to install). Mutates and returns."""
    load_library()
    from mlx.utils import tree_unflatten

    replacements = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.ndim == 2:
            replacements.append((path, Int8Linear(module.weight, module.get("bias"))))
        elif isinstance(module, nn.Embedding):
            replacements.append((path, Int8Embedding(module.weight)))
    if replacements:
        model.update_modules(tree_unflatten(replacements))
    mx.eval(model.parameters())
    return model
