"""The host layers' packed arrays between starts, as the layers take and keep them
(engine/host/linear.py); engine/host/weights_cache.py reads and writes them to disk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

PACKED_PARTS = ("packed", "scales", "bias", "plain")  # what a layer keeps in a PackedCache


@dataclass(eq=False)
class PackedCache:
    """The host layers' arrays kept between starts (engine/host/weights_cache.py writes them
    to disk): packing is most of a load (1.7B: 25 s, 8B: 169 s), reading back the packed
    bytes is not. Arrays are keyed `<layer key>.<part>` (packed, scales, bias, plain); `found`
    holds what a file had (the packed bytes as read-only numpy views of the mapped file, the
    other parts as MLX arrays), `kept` what the model ended with, `packed` how many layers were
    packed anew (0: nothing to write); `room`, where set, gives a layer the bytes to pack into
    in the file being written (weights_cache.PackArena: no copy into the file after), or None
    (then fresh memory)."""

    found: dict[str, mx.array | np.ndarray] = field(default_factory=dict)
    kept: dict[str, mx.array | np.ndarray] = field(default_factory=dict)
    packed: int = 0
    room: Callable[[int], np.ndarray | None] | None = None

    def take(self, key: str) -> dict[str, mx.array | np.ndarray] | None:
        parts = {p: self.found[f"{key}.{p}"] for p in PACKED_PARTS if f"{key}.{p}" in self.found}
        return parts if "packed" in parts else None

    def keep(self, key: str, parts: dict[str, mx.array | np.ndarray | None]) -> None:
        self.kept.update({f"{key}.{k}": v for k, v in parts.items() if v is not None})
