"""The file's weights written as one safetensors file, a piece at a time: the header first
(every shape and dtype is known from the GGUF table), then each tensor read, dequantized,
transformed and written in slices of rows (whole, for the q/k matrices un-permuted across a
head's rows). Peak memory is one slice (or one q/k matrix), whatever the model's size;
quantized types become float32, float types keep their width."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from batchmlx.engine.models.gguf.families import Placed, Transform, unpermute
from batchmlx.engine.models.gguf.reader import FLOAT_TYPES, GGUFFile, as_float32, tensor_array

_ALIGN = 8  # safetensors' header is padded so the data starts 8-byte aligned
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2}
_SLICE_BYTES = 4 << 20  # float32 output per slice of rows (gguf-py holds two while dequantizing)


def out_dtype(type_name: str, transform: Transform) -> str:
    """The safetensors dtype a tensor is written in."""
    if transform is Transform.MINUS_ONE:
        return "F32"
    return FLOAT_TYPES.get(type_name, "F32")


def write_safetensors(
    f: GGUFFile, placed: list[Placed], heads: tuple[int, int], dest: Path
) -> None:
    """`placed` from `f` into `dest` (heads: query and key/value head counts, to un-permute)."""
    header: dict[str, object] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for p in placed:
        t = f.tensors[p.source]
        dtype = out_dtype(t.type_name, p.transform)
        size = int(np.prod(t.shape)) * _ITEM_BYTES[dtype]
        header[p.target] = {"dtype": dtype, "shape": list(t.shape),
                            "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    with open(dest, "wb") as out:
        out.write(len(raw).to_bytes(8, "little"))
        out.write(raw)
        for p in placed:
            for array in _converted(f, p, heads):
                out.write(memoryview(np.ascontiguousarray(array)).cast("B"))


def _converted(f: GGUFFile, p: Placed, heads: tuple[int, int]) -> Iterator[np.ndarray]:
    """`p`'s tensor in slices of rows, in order (one piece where rows depend on each other)."""
    t = f.tensors[p.source]
    if len(t.shape) != 2 or p.transform in (Transform.UNPERMUTE_Q, Transform.UNPERMUTE_K):
        yield _transformed(tensor_array(t), p, t.type_name, heads)
        return
    step = max(1, _SLICE_BYTES // (4 * t.shape[1]))
    for start in range(0, t.shape[0], step):
        rows = slice(start, min(start + step, t.shape[0]))
        yield _transformed(tensor_array(t, rows), p, t.type_name, heads)


def _transformed(
    array: np.ndarray, p: Placed, type_name: str, heads: tuple[int, int]
) -> np.ndarray:
    if p.transform is Transform.MINUS_ONE:
        return as_float32(array, type_name) - np.float32(1.0)
    if p.transform is Transform.UNPERMUTE_Q:
        return unpermute(array, heads[0])
    if p.transform is Transform.UNPERMUTE_K:
        return unpermute(array, heads[1])
    return array
