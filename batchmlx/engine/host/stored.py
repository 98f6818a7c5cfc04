"""A layer's weights as the model stores them, for a host format to pack (engine/host/linear.py):
float arrays as they are; MLX affine-quantized ones with float32 scales (a converted GGUF's)
as `Dequantized`, read in numpy only when packed, so that a layer taken from the weights cache
never reads them, and a 4-bit one can keep its bits (`four_bit`: the q4 format)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host import head8, q4, quantized


@dataclass(frozen=True, eq=False)
class Dequantized:
    """An affine-quantized layer's weight with float32 scales (a converted GGUF's), dequantized
    in numpy (host/quantized.py: ~10x mx.dequantize on the CPU) when its layer is packed, never
    where the packed layer comes from the weights cache."""

    module: nn.Module
    expert: int | None = None  # of a QuantizedSwitchLinear: this expert's [N, K]

    @property
    def shape(self) -> tuple[int, int]:
        rows, words = self.module.weight.shape[-2:]
        return rows, words * 32 // self.module.bits

    def array(self) -> mx.array:
        m = self.module
        out = mx.zeros(self.shape, mx.float32)  # written in place: one float32 copy, MLX's
        mx.eval(out)
        quantized.dequantize(*self.parts(), m.bits, m.group_size, out=np.asarray(out))
        return out

    def parts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stored values (uint32 words), scales and biases, as they are."""
        m = self.module
        parts = [m.weight, m.scales, m.biases]
        if self.expert is not None:
            parts = [a[self.expert] for a in parts]
        w, s, b = map(np.asarray, parts)
        return w, s, b


def float_weight(module: nn.Module) -> mx.array | Dequantized:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if getattr(module, "mode", "affine") == "affine" and module.scales.dtype == mx.float32:
            return Dequantized(module)
        return mx.dequantize(module.weight, module.scales, module.get("biases"),
                             group_size=module.group_size, bits=module.bits,
                             mode=getattr(module, "mode", "affine"))  # fmt: skip
    return module.weight


def four_bit(weights: list[mx.array | Dequantized]) -> bool:
    """Whether q4's kernel takes `weights` (one GEMM's, concatenated along N) as they are
    stored: each 4-bit affine in groups of 32 (a converted GGUF's Q4_0, Q4_1, Q4_K), and the
    shape; not a Q6_K layer (kept in 8 bits), nor a float one."""
    four = all(isinstance(w, Dequantized) and w.module.bits == 4
               and w.module.group_size == q4.GROUP for w in weights)  # fmt: skip
    n = sum(w.shape[0] for w in weights)
    return four and q4.available() and q4.fits(n, weights[0].shape[1])


def eight_bit(weights: list[mx.array | Dequantized]) -> head8.Head8Weights:
    """One GEMM's weights (concatenated along N) as the 8-bit head's: a Q8_0 table (a converted
    GGUF's 8-bit affine with bias -128 s) exactly as stored, else rounded per group of 32."""
    w = weights[0]
    if (len(weights) == 1 and isinstance(w, Dequantized) and w.module.bits == 8
            and w.module.group_size == head8.GROUP):  # fmt: skip
        exact = head8.Head8Weights.of_q8_0(*w.parts())
        if exact is not None:
            return exact
    rows = [w.array() if isinstance(w, Dequantized) else w for w in weights]
    return head8.Head8Weights.of_float(table(joined(rows)))


def table(a: mx.array) -> np.ndarray:
    """A float table as numpy without a widened copy, for the kernels that pack it as it lies
    (native/widen.h): bf16 as its bits (uint16), float16 and float32 as they are; another type
    as float32."""
    if a.dtype == mx.bfloat16:
        return np.asarray(a.view(mx.uint16))
    if a.dtype in (mx.float16, mx.float32):
        return np.asarray(a)
    return np.asarray(a.astype(mx.float32))


def joined_bias(weights: list[mx.array | Dequantized],
                biases: list[mx.array | None]) -> np.ndarray | None:  # fmt: skip
    """The layers' biases concatenated (zeros for a layer without), or None where none has."""
    if all(b is None for b in biases):
        return None
    return np.concatenate([np.zeros(w.shape[0], np.float32) if b is None
                           else np.asarray(b.astype(mx.float32))
                           for w, b in zip(weights, biases, strict=True)])  # fmt: skip


def joined(weights: list[mx.array]) -> mx.array:
    """Tables of one K stacked along N (a layer's q, k and v): over their stored bits in numpy,
    then one MLX array. MLX's CPU concatenation of a 1.7B model's bf16 q, k, v and gate, up
    took ~6 s of a first start beside ~2 s to read them."""
    if len(weights) == 1:
        return weights[0]
    parts = [table(w) for w in weights]
    if len({p.dtype for p in parts}) > 1 or len({w.dtype for w in weights}) > 1:
        return mx.concatenate(weights, axis=0)
    out = mx.array(np.concatenate(parts))
    return out.view(weights[0].dtype) if weights[0].dtype == mx.bfloat16 else out
