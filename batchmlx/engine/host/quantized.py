"""MLX's affine-quantized arrays (what `nn.QuantizedLinear` holds) in numpy: `pack` writes them
(the GGUF converter, engine/models/gguf/affine.py) and `dequantize` reads them back, for a host
format packing a quantized layer. The weight is a little-endian stream of `bits`-bit values per
row, read as uint32 [R, K * bits / 32]; w = scale * q + bias per group of `group` along K.

Why not `mx.dequantize`: on MLX's CPU backend it ran at 14 M values/s for 4 bits, 4 M for 5
bits and 28 M for 8 (2-core Xeon, load 6, 2026-12-06): two minutes of a 1.7B model's first
start, ten of an 8B's. This ran at 130-160 M/s for 4 bits there. Pure numpy."""

from __future__ import annotations

import numpy as np

_CHUNK = 1 << 18  # values dequantized at once (1 MB of float32: in the CPU's cache)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """q[R, K] (uint8, each < 2**bits; K a multiple of 8) as MLX packs it: uint32
    [R, K * bits / 32] (eight values fill `bits` bytes)."""
    rows, cols = q.shape
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if bits == 8:
        return q.view("<u4")
    if bits == 4:
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view("<u4")
    eight = q.reshape(rows, cols // 8, 8)
    words = eight[:, :, 0].astype(np.uint64)
    for i in range(1, 8):
        words |= eight[:, :, i].astype(np.uint64) << np.uint64(bits * i)
    stream = words.astype("<u8").view(np.uint8).reshape(rows, cols // 8, 8)[:, :, :bits]
    return np.ascontiguousarray(stream).reshape(rows, cols * bits // 8).view("<u4")


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """The values q[R, K] (uint8) of a packed weight (the inverse of `pack`)."""
    rows = weight.shape[0]
    stream = np.ascontiguousarray(weight).view(np.uint8).reshape(rows, -1)
    cols = stream.shape[1] * 8 // bits
    if bits == 8:
        return stream
    if bits == 4:
        q = np.empty((rows, cols), np.uint8)
        q[:, 0::2] = stream & 0x0F
        q[:, 1::2] = stream >> 4
        return q
    padded = np.zeros((rows, cols // 8, 8), np.uint8)
    padded[:, :, :bits] = stream.reshape(rows, cols // 8, bits)
    words = padded.view("<u8")[:, :, 0]
    q = np.empty((rows, cols // 8, 8), np.uint8)
    mask = np.uint64((1 << bits) - 1)
    for i in range(8):
        q[:, :, i] = (words >> np.uint64(bits * i)) & mask
    return q.reshape(rows, cols)


def dequantize(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
               group: int, out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
    """float32 [R, K], into `out` when given (a buffer MLX owns: no copy into MLX after, and no
    second float32 copy of the layer at once): scale * q + bias, a product then a sum, each
    rounded to float32 (where the products are exact, as for every format the GGUF converter
    keeps, this is MLX's result and gguf-py's bit for bit). A few rows at a time, in cache."""
    rows = weight.shape[0]
    cols = weight.shape[1] * 32 // bits
    if out is None:
        out = np.empty((rows, cols), np.float32)
    s = np.asarray(scales, np.float32).reshape(rows, cols // group, 1)
    b = np.asarray(biases, np.float32).reshape(rows, cols // group, 1)
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        w = out[r : r + step].reshape(-1, cols // group, group)
        np.copyto(w, unpack(weight[r : r + step], bits).reshape(w.shape))
        w *= s[r : r + step]
        w += b[r : r + step]
    return out
