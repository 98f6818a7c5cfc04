"""Rotary position embeddings of the host steps (engine/host/step.py): every RoPE mlx-lm builds
(plain, linear-scaled, llama3, yarn, su/longrope) as one numpy form, and `rope_of` reading it
from a model's rope module.

Each of them is `mx.fast.rope` over the first `dims` of a head: a plain RoPE with its base (and
a position scale), or given frequencies (llama3, yarn, su: their own `_freqs`), the yarn and su
ones on an input scaled by a factor first (`mscale`). Here that is one rotation against per-step
tables of cos and signed sin; the factor is folded into the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host import ops


@dataclass(frozen=True, slots=True)
class RopeTables:
    """A step's RoPE factors: each row's angles' cos and sin [T, dims / 2] (our kernel reads
    these), and for the numpy form the same spread over every element, [T, (query + KV heads)
    x head_dim] (None where the kernel runs)."""

    half_cos: np.ndarray
    half_sin: np.ndarray
    cos: np.ndarray | None  # 1 on the dims RoPE leaves alone
    sin: np.ndarray | None  # -sin on a pair's first element, +sin on its second; 0 elsewhere


@dataclass(frozen=True, slots=True)
class HostRope:
    """A model's RoPE of its q and k heads, in numpy (its dims, traditional, base, scale; or
    its frequencies and input factor)."""

    dims: int
    traditional: bool
    base: float
    scale: float
    head_dim: int
    heads: int  # query + KV heads, rotated in one pass
    # given frequencies (mx.fast.rope's `freqs`: the angle is position / freq), else the base's
    freqs: np.ndarray | None = field(default=None, compare=False)
    mscale: float = 1.0  # the rotated dims times this first (yarn, su)

    @property
    def key(self) -> tuple:
        """What makes two ropes rotate alike (layers sharing one share the step's tables)."""
        f = None if self.freqs is None else self.freqs.tobytes()
        return (self.dims, self.traditional, self.base, self.scale, f, self.mscale)

    def tables(self, positions: np.ndarray) -> RopeTables:
        """Each row's cos and signed sin over the q and k heads' elements, for its position (as
        elementwise.rope_table): `rotate` reads them as whole rows."""
        half = self.dims // 2
        if self.freqs is None:
            inv = np.exp(
                np.arange(0, -half, -1, dtype=np.float32) * np.float32(math.log(self.base) / half)
            )
        else:
            inv = np.float32(1.0) / self.freqs
        theta = (positions.astype(np.float32) * np.float32(self.scale))[:, None] * inv
        cos, sin = np.cos(theta), np.sin(theta)
        if self.mscale != 1.0:  # (m x) cos - (m x') sin: the factor in the tables
            cos *= np.float32(self.mscale)
            sin *= np.float32(self.mscale)
        if ops.available():
            return RopeTables(cos, sin, None, None)
        t, d = positions.shape[0], self.head_dim
        c, s = np.ones((t, d), np.float32), np.zeros((t, d), np.float32)  # past dims: as is
        first, second = self._pairs()
        c[:, first], c[:, second] = cos, cos
        s[:, first], s[:, second] = -sin, sin
        return RopeTables(cos, sin, np.tile(c, (1, self.heads)), np.tile(s, (1, self.heads)))

    def _pairs(self) -> tuple[slice, slice]:
        """The elements of a head rotated together: (first, second) of each pair."""
        if self.traditional:  # pairs (2i, 2i + 1)
            return slice(0, self.dims, 2), slice(1, self.dims, 2)
        return slice(0, self.dims // 2), slice(self.dims // 2, self.dims)  # (i, i + dims / 2)

    def rotate_scaled(self, x: np.ndarray, rope: RopeTables, scaled: int,
                      scale: np.float32) -> np.ndarray:  # fmt: skip
        """x's rows [T, heads x D] (a view of the GEMM's rows, or normed heads) rotated by
        their row's positions, then the first `scaled` heads (the queries) times `scale`, as a
        new [T, heads, D] array: in one pass of our kernel where it runs, else `rotate`."""
        t = x.shape[0]
        if rope.cos is None:
            return ops.rope(x, self.heads, self.head_dim, self.dims, self.traditional,
                            rope.half_cos, rope.half_sin, scaled, float(scale))  # fmt: skip
        out = self.rotate(x.reshape(t, self.heads, self.head_dim), rope)
        out[:, :scaled] *= scale
        return out

    def rotate(self, x: np.ndarray, rope: RopeTables) -> np.ndarray:
        """x [T, heads, D] (a view of the GEMM's rows) rotated by its row's position, a new
        array: x * cos + swapped(x) * signed sin, where swapped exchanges each pair. The
        products and sums are nn.RoPE's (x1 cos - x2 sin, x1 sin + x2 cos), bit for bit, in
        three whole-row passes and a copy; per half-head views took 3.5x as long (1,776
        prompt tokens, alone: 3.3 ms a layer against 0.95; a width-64 prefill's RoPE 162 ->
        110 ms)."""
        assert rope.cos is not None and rope.sin is not None
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


class NotCovered(Exception):
    """A part of a model the host step has no form of (the message says which)."""


def rope_of(module: nn.Module, head_dim: int, heads: int) -> HostRope | None:
    """The HostRope of an attention's `rope` module; None for a layer without RoPE (smollm3's
    NoPE). Raises NotCovered for a kind it does not know (e.g. dynamic NTK, whose base follows
    the sequence's length)."""
    from mlx_lm.models import rope_utils

    kind = type(module)
    if kind is nn.RoPE:
        return HostRope(int(module.dims), bool(module.traditional), float(module.base),
                        float(module.scale), head_dim, heads)  # fmt: skip
    if kind.__module__ == "mlx_lm.models.smollm3" and kind.__name__ == "NoPE":
        return None  # an identity (smollm3: every fourth layer by default)
    freqs = getattr(module, "_freqs", None)
    if freqs is None:
        raise NotCovered(f"rope {kind.__name__}")
    f = np.asarray(freqs.astype(mx.float32))
    if kind is rope_utils.Llama3RoPE:
        return HostRope(int(module.dims), bool(module.traditional), 0.0, 1.0, head_dim, heads, f)
    if kind is rope_utils.YarnRoPE:
        return HostRope(int(module.dims), bool(module.traditional), 0.0, 1.0, head_dim, heads, f,
                        float(module.mscale))  # fmt: skip
    if kind is rope_utils.SuScaledRoPE:  # (mlx-lm applies the long factors at every length)
        return HostRope(int(module.dim), False, 0.0, 1.0, head_dim, heads, f,
                        float(module._scale))  # fmt: skip
    raise NotCovered(f"rope {kind.__name__}")
