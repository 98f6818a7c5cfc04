"""The file's weights written as one safetensors file, a piece at a time: the header first
(every shape and dtype is known from the GGUF table), then each tensor read, converted,
transformed and written in slices of rows (whole, for the q/k matrices un-permuted across a
head's rows). Peak memory is one slice (or one q/k matrix), whatever the model's size.

A quantized matrix keeps its bits as MLX's affine format (affine.py: `weight` packed, `scales`,
`biases`, three tensors of the folder written side by side, each slice at its place), and
`quantization` gives config.json the entry mlx-lm builds QuantizedLinear, QuantizedEmbedding
and (a mixture of experts' stacked [experts, rows, columns] matrices, written as the rows of
all experts in turn) QuantizedSwitchLinear layers from. Float types keep their width; a
quantized vector (rare) becomes float32."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchmlx.engine.models.gguf.affine import AFFINE, GROUP, Affine, affine_rows
from batchmlx.engine.models.gguf.families import Placed, Transform, unpermute
from batchmlx.engine.models.gguf.reader import (
    FLOAT_TYPES,
    GGUFFile,
    Tensor,
    as_float32,
    tensor_array,
)

_ALIGN = 8  # safetensors' header is padded so the data starts 8-byte aligned
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}
_SLICE_BYTES = 4 << 20  # float32 output per slice of rows (gguf-py holds two while dequantizing)


@dataclass(frozen=True, slots=True)
class Stored:
    """One tensor of the folder's safetensors file."""

    name: str  # mlx-lm's parameter name
    dtype: str  # safetensors' dtype name
    shape: tuple[int, ...]


def out_dtype(type_name: str, transform: Transform) -> str:
    """The safetensors dtype a tensor is written in when it is written as floats."""
    if transform is Transform.MINUS_ONE:
        return "F32"
    return FLOAT_TYPES.get(type_name, "F32")


def kept_bits(t: Tensor, p: Placed) -> Affine | None:
    """The affine format `p`'s tensor keeps its bits in (a quantized matrix, or the experts'
    stacked matrices), or None."""
    if len(t.shape) not in (2, 3) or p.transform is Transform.MINUS_ONE:
        return None
    if not p.target.endswith(".weight"):
        return None
    return AFFINE.get(t.type_name)


def stored(t: Tensor, p: Placed) -> list[Stored]:
    """What `p`'s tensor becomes in the folder: one float tensor, or weight, scales and biases."""
    kind = kept_bits(t, p)
    if kind is None:
        return [Stored(p.target, out_dtype(t.type_name, p.transform), t.shape)]
    *rows, cols = t.shape
    base = p.target.removesuffix(".weight")
    return [Stored(p.target, "U32", (*rows, cols * kind.bits // 32)),
            Stored(f"{base}.scales", "F32", (*rows, cols // GROUP)),
            Stored(f"{base}.biases", "F32", (*rows, cols // GROUP))]  # fmt: skip


def quantization(f: GGUFFile, placed: list[Placed]) -> dict[str, Any] | None:
    """config.json's `quantization`: the most common bits as the default, each layer of other
    bits by its path (mlx-lm's format for mixed bits); None where nothing is quantized."""
    bits = {p.target.removesuffix(".weight"): kind.bits for p in placed
            if (kind := kept_bits(f.tensors[p.source], p)) is not None}  # fmt: skip
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    out: dict[str, Any] = {"group_size": GROUP, "bits": default, "mode": "affine"}
    out.update({path: {"group_size": GROUP, "bits": b} for path, b in bits.items() if b != default})
    return out


def write_safetensors(
    f: GGUFFile, placed: list[Placed], heads: tuple[int, int], dest: Path
) -> None:
    """`placed` from `f` into `dest` (heads: query and key/value head counts, to un-permute)."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    starts: dict[str, int] = {}
    offset = 0
    for p in placed:
        for s in stored(f.tensors[p.source], p):
            size = int(np.prod(s.shape)) * _ITEM_BYTES[s.dtype]
            header[s.name] = {"dtype": s.dtype, "shape": list(s.shape),
                              "data_offsets": [offset, offset + size]}  # fmt: skip
            starts[s.name] = offset
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    data = 8 + len(raw)
    with open(dest, "wb") as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        out.truncate(data + offset)
        for p in placed:
            for piece in _converted(f, p, heads):
                for name, array in piece.items():  # each slice where its tensor's bytes go
                    out.seek(data + starts[name])
                    out.write(memoryview(np.ascontiguousarray(array)).cast("B"))
                    starts[name] += array.nbytes


def _converted(f: GGUFFile, p: Placed, heads: tuple[int, int]) -> Iterator[dict[str, np.ndarray]]:
    """`p`'s stored tensors in slices of rows, in order (one piece where rows depend on each
    other)."""
    t = f.tensors[p.source]
    kind = kept_bits(t, p)
    # stacked experts kept in their bits go as rows too: [E, R, X] is laid out as [E * R, X]
    sliced = len(t.shape) == 2 or (kind is not None and len(t.shape) == 3)
    if not sliced or p.transform in (Transform.UNPERMUTE_Q, Transform.UNPERMUTE_K):
        yield _transformed(_piece(t, p, kind, None), p, t.type_name, heads)
        return
    total = int(np.prod(t.shape[:-1]))
    step = max(1, _SLICE_BYTES // (4 * t.shape[-1]))
    for start in range(0, total, step):
        rows = slice(start, min(start + step, total))
        yield _transformed(_piece(t, p, kind, rows), p, t.type_name, heads)


def _piece(t: Tensor, p: Placed, kind: Affine | None, rows: slice | None) -> dict[str, np.ndarray]:
    if kind is None:
        return {p.target: tensor_array(t, rows)}
    raw = np.asarray(t.raw)
    raw = raw.reshape(-1, raw.shape[-1])  # the experts' rows in turn (a matrix: unchanged)
    a = affine_rows(raw if rows is None else raw[rows], t.type_name, t.shape[-1])
    base = p.target.removesuffix(".weight")
    return {p.target: a.weight, f"{base}.scales": a.scales, f"{base}.biases": a.biases}


def _transformed(
    piece: dict[str, np.ndarray], p: Placed, type_name: str, heads: tuple[int, int]
) -> dict[str, np.ndarray]:
    if p.transform is Transform.MINUS_ONE:
        return {k: as_float32(a, type_name) - np.float32(1.0) for k, a in piece.items()}
    if p.transform is Transform.UNPERMUTE_Q:  # rows move whole: packed rows alike
        return {k: unpermute(a, heads[0]) for k, a in piece.items()}
    if p.transform is Transform.UNPERMUTE_K:
        return {k: unpermute(a, heads[1]) for k, a in piece.items()}
    return piece
