"""A GGUF file read with gguf-py (memory-mapped: no tensor is read until asked), its metadata
as plain Python values, and its tensors (or slices of their rows) dequantized to numpy. No MLX.
(The submit-time check reads less: core/gguf_support.scan_header skips the vocabulary.)"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchmlx.core.gguf_support import GGUFSummary, first_unknown

# ggml types stored as plain floats: kept in their own width (no dequantization to do)
FLOAT_TYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16"}


class GGUFConversionError(ValueError):
    """The GGUF file uses an architecture, type or tokenizer this converter does not handle."""


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of the file, not yet read."""

    name: str  # llama.cpp's name (blk.0.attn_q.weight)
    type_name: str  # ggml type (Q4_K, F16, ...)
    shape: tuple[int, ...]  # numpy order (rows first), in elements
    raw: Any  # the memory-mapped bytes (or elements, for float types)


@dataclass
class GGUFFile:
    """The header as Python values and the tensors, by name."""

    path: Path
    meta: dict[str, Any]
    tensors: dict[str, Tensor]

    @property
    def arch(self) -> str:
        return str(self.meta.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """`{arch}.key` (the per-architecture keys llama.cpp writes)."""
        return self.meta.get(f"{self.arch}.{key}", default)


def open_gguf(path: Path) -> GGUFFile:
    """The file's header and tensor table; GGUFConversionError if it is no GGUF gguf-py reads."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise GGUFConversionError(f"{Path(path).name} cannot be read as GGUF: {exc}") from exc
    meta = {name: _value(field) for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = Tensor(t.name, t.tensor_type.name, shape, t.data)
    return GGUFFile(Path(path), meta, tensors)


def summary(f: GGUFFile) -> GGUFSummary:
    types: dict[str, str] = {}
    for t in f.tensors.values():
        types.setdefault(t.type_name, t.name)
    scaling = f.get("rope.scaling.type")
    pre = f.meta.get("tokenizer.ggml.pre")
    return GGUFSummary(
        architecture=f.arch,
        tensor_types=types,
        tokenizer=f.meta.get("tokenizer.ggml.model"),
        rope_scaling=None if scaling is None else str(scaling),
        pre_tokenizer=None if pre is None else str(pre),
        unknown_tensor=first_unknown(f.tensors, f.arch),
    )


def tensor_array(t: Tensor, rows: slice | None = None) -> np.ndarray:
    """`t` (or its `rows`, for a matrix) as numpy in its own float width (F32, F16, or BF16 as
    raw uint16) or, for a quantized type, dequantized to float32 by gguf-py (vectorized)."""
    import gguf

    raw = np.asarray(t.raw)
    shape = t.shape
    if rows is not None:
        assert len(t.shape) == 2, t.name  # a matrix's rows: whole blocks, each row its own
        raw = raw[rows]
        shape = (raw.shape[0], t.shape[1])
    if t.type_name == "BF16":
        return raw.view(np.uint16).reshape(shape)
    if t.type_name in FLOAT_TYPES:
        return raw.reshape(shape)
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.type_name]).reshape(shape)


def as_float32(array: np.ndarray, type_name: str) -> np.ndarray:
    """A tensor_array result as float32 (for the few tensors that are transformed)."""
    if type_name == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _value(field: Any) -> Any:
    # scalars as Python scalars, strings as str, arrays as lists (of str or numbers)
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return np.concatenate([field.parts[i] for i in field.data]).tolist() if field.data else []
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]
