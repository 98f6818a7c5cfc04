"""A GGUF file's RoPE scaling as the `rope_scaling` dict of a Hugging Face config.json, which
mlx-lm's `initialize_rope` reads. Pure numpy.

linear and yarn are metadata keys. llama3's (Llama 3.1-3.3) is not: llama.cpp's converter
writes its per-frequency factors as the `rope_freqs` tensor, so its parameters are recovered
from the factors and checked to give them back."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from batchmlx.engine.models.gguf.reader import GGUFConversionError

_LLAMA3_HIGH = 4.0  # high_freq_factor of every Llama 3.x (low_freq_factor is 1)


def from_keys(get: Any) -> dict[str, Any] | None:
    """linear or yarn scaling from `{arch}.rope.scaling.*` (get: key -> value or None)."""
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor") or get("rope.scale_linear")
    if kind in (None, "none", "linear") and (not factor or float(factor) == 1.0):
        return None
    if kind in (None, "linear"):
        return {"type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"type": "yarn", "factor": float(factor)}
        original = get("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = get(f"rope.scaling.{key}")
            if value is not None:
                scaling[ours] = float(value)
        return scaling
    raise GGUFConversionError(f"RoPE scaling {kind!r} is not supported")


def llama3_factors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The factors llama.cpp's converter writes to rope_freqs for `scaling` (HF's formula)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def llama3_from_factors(factors: np.ndarray, base: float, dims: int) -> dict[str, Any]:
    """The llama3 `rope_scaling` that gives `factors` back (to float32 precision).

    The factor is the largest; between the two thresholds 1/f is linear in 1/wavelength,
    smooth = old/wavelen * 1/(high-low) - low/(high-low), so two such points give old and high
    with low = 1 (as in every Llama 3.x); with fewer, high = 4 is assumed."""
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    high = _LLAMA3_HIGH
    if mid.sum() >= 2:
        slope, icept = np.polyfit(1 / wavelen[mid], smooth[mid], 1)
        high = 1 - 1 / icept
        old = slope * (high - 1)
    elif mid.sum() == 1:
        i = int(np.argmax(mid))
        old = wavelen[i] * (1 + (high - 1) * smooth[i])
    else:  # a step: old/high falls between the last factor 1 and the first factor `factor`
        first = int(np.argmax(factors > 1 + 1e-6))
        old = high * float(np.sqrt(wavelen[first] * wavelen[max(first - 1, 0)]))
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(round(high, 4)),
               "original_max_position_embeddings": int(round(old))}  # fmt: skip
    if not np.allclose(llama3_factors(scaling, base, dims), factors, rtol=1e-4, atol=1e-5):
        raise GGUFConversionError("its llama3 RoPE factors (rope_freqs) match no llama3 scaling")
    return scaling
