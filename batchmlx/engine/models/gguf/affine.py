"""A quantized GGUF tensor as MLX's affine-quantized arrays (what `nn.QuantizedLinear` and
`nn.QuantizedEmbedding` hold): `weight` the values q packed into uint32 (`bits` each, little
end first: engine/host/quantized.py), `scales` and `biases` one per group of 32 along K,
w = scale * q + bias.

Where ggml's format is affine over 32 values the bits are kept as they are, exactly: Q8_0
(w = d*q, q in [-127, 127]: 8 bits, q + 128, bias -128d), Q4_0 (d*(q-8): bias -8d), Q4_1
(d*q + m), Q5_0, Q5_1, and the K-quants with 32-value sub-blocks, Q4_K and Q5_K (w = d*sc*q -
dmin*m: scale d*sc, bias -dmin*m). MLX computes scale * q + bias in float32 as gguf-py does
(every product exact, one rounding at the sum), so the dequantized values are gguf-py's bit for
bit. Scales and biases are float32: the K-quants' d*sc has 17 significant bits, and with
float16 ones (the legacy types' d and m are) MLX dequantizes to float16, rounding d*q.
Q6_K, Q3_K and Q2_K scale sub-blocks of 16 values, a group size MLX does not take (32, 64, 128):
they are requantized from gguf-py's values to 8 bits over 32 (min/max affine), which adds an
error of 0.25x Q6_K's own RMS error and 0.03x Q3_K's on SmolLM2-135M (docs/models.md).
Pure numpy: no MLX."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchmlx.engine.host.quantized import pack

GROUP = 32


@dataclass(frozen=True, slots=True)
class Affine:
    """How one ggml type is stored in MLX's affine format."""

    bits: int
    exact: bool  # the values are the file's (False: requantized from gguf-py's dequantization)


AFFINE = {
    "Q8_0": Affine(8, True),
    "Q4_0": Affine(4, True),
    "Q4_1": Affine(4, True),
    "Q5_0": Affine(5, True),
    "Q5_1": Affine(5, True),
    "Q4_K": Affine(4, True),
    "Q5_K": Affine(5, True),
    "Q6_K": Affine(8, False),
    "Q3_K": Affine(8, False),
    "Q2_K": Affine(8, False),
}


@dataclass(frozen=True, slots=True)
class AffineRows:
    """Rows of one tensor in MLX's affine format."""

    weight: np.ndarray  # uint32 [R, K * bits / 32]
    scales: np.ndarray  # float32 [R, K / 32]
    biases: np.ndarray  # float32 [R, K / 32]


def affine_rows(raw: np.ndarray, type_name: str, cols: int) -> AffineRows:
    """`raw` (rows of a `type_name` tensor's blocks, [R, bytes per row]) as affine rows of
    `cols` values each."""
    kind = AFFINE[type_name]
    rows = raw.shape[0]
    if kind.exact:
        q, scale, bias = _DECODE[type_name](_blocks(np.asarray(raw), type_name))
    else:
        import gguf

        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
        q, scale, bias = requantize(w.reshape(-1, GROUP), kind.bits)
    return AffineRows(
        weight=pack(q.reshape(rows, cols), kind.bits),
        scales=scale.reshape(rows, cols // GROUP),
        biases=bias.reshape(rows, cols // GROUP),
    )


def requantize(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups w[n, GROUP] (float32) to `bits` by their min and max: q = round((w - min) /
    scale), scale = (max - min) / (2**bits - 1), bias = min (an error of at most half a step)."""
    top = np.float32(2**bits - 1)
    lo = w.min(axis=1, keepdims=True)
    span = w.max(axis=1, keepdims=True) - lo
    scale = np.where(span > 0, span / top, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint((w - lo) * (np.float32(1) / scale)), 0, top).astype(np.uint8)
    return q, scale, lo


def _blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    import gguf

    _, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    return np.ascontiguousarray(raw).reshape(-1, size)


def _f32(b: np.ndarray) -> np.ndarray:
    """Two bytes a block (float16) as float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 values: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes a block (Q5_0, Q5_1) -> each value's fifth bit, shifted in place."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return bits << 4


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, 0:2])
    q = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, d * np.float32(-128)


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, 0:2])
    return _nibbles(b[:, 2:]), d, d * np.float32(-8)


def _q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:]), _f32(b[:, 0:2]), _f32(b[:, 2:4])


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f32(b[:, 0:2])
    return _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6]), d, d * np.float32(-16)


def _q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8]), _f32(b[:, 0:2]), _f32(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 8 sub-block scales d*sc and biases -dmin*m, [n, 8] float32, computed
    as gguf-py computes them."""
    import gguf

    sc, m = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scale = _f32(b[:, 0:2]) * sc.astype(np.float32)
    return scale, -(_f32(b[:, 2:4]) * m.astype(np.float32))


def _k_low(qs: np.ndarray) -> np.ndarray:
    """128 bytes a block -> 256 values: each 32 bytes' low nibbles are a sub-block, their high
    nibbles the next."""
    n = qs.shape[0]
    chunks = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(n, 256)


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, bias = _k_scales(b)
    return _k_low(b[:, 16:]), scale, bias


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    scale, bias = _k_scales(b)
    n = b.shape[0]
    # sub-block i's fifth bits are bit i of the 32 bytes of qh
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_low(b[:, 48:]) | ((qh & 1) << 4).reshape(n, 256), scale, bias


_DECODE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k}  # fmt: skip
