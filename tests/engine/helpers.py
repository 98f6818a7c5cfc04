"""Shared references for the attention tests."""

from __future__ import annotations

import numpy as np


def naive(q, k, v, scale, mask):
    """Reference in float64 numpy: softmax over the keys each query may see."""
    q, k, v, mask = (np.array(x).astype(np.float64) for x in (q, k, v, mask))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.where(mask.astype(bool), q @ k.swapaxes(-1, -2) * scale, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v
