"""What a GGUF file must hold for batchmlx to serve it: its architecture, its tensor types, its
tokenizer and RoPE scaling. Both the submit-time check (batches/models.py) and the converter
(engine/models/gguf) judge a header here, so a file refused at submit time is the file the
converter would refuse, with the same message.

`scan_header` reads just the header from a stream the caller opened, skipping the arrays
(vocabularies of 150k strings): gguf-py's reader parses every one of them (4 s for a 49k vocab),
too slow for a check made at each submit."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

# general.architecture -> the mlx-lm model_type that runs it (docs/models.md lists them)
ARCHITECTURES: Mapping[str, str] = {
    "llama": "llama",  # Llama 1-3.x, Mistral 7B, SmolLM2, and others llama.cpp writes as llama
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "granite": "granite",
    "olmo2": "olmo2",
    "smollm3": "smollm3",
    "qwen3moe": "qwen3_moe",  # Qwen3-30B-A3B and its kin
    "olmoe": "olmoe",
}
# ggml tensor types dequantized on load (gguf-py's numpy code); the names are GGMLQuantizationType's
TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
     "Q6_K"}
)  # fmt: skip
TOKENIZERS = frozenset({"gpt2", "llama"})  # BPE (byte-level) and SentencePiece
# tokenizer.ggml.pre of a gpt2 vocabulary: llama.cpp's names of the splits before BPE, each with
# its regex in engine/models/gguf/tokenizer.py
PRE_TOKENIZERS = frozenset(
    {"default", "gpt-2", "smollm", "starcoder", "refact", "llama-bpe", "llama3", "dbrx",
     "smaug-bpe", "qwen2", "olmo"}
)  # fmt: skip
ROPE_SCALINGS = frozenset({"none", "linear", "yarn"})  # llama3's comes as a rope_freqs tensor
# llama.cpp's tensor names the converter maps (blk.N.NAME.weight|bias, or NAME.weight at the top):
# anything else (a vision tower, shared experts, a mixture of experts in an architecture whose
# model has none: Mixtral's files say "llama") is refused
LAYER_TENSORS = frozenset(
    {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm",
     "attn_k_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm", "ffn_gate", "ffn_up",
     "ffn_down"}
)  # fmt: skip
# a mixture of experts' router and its experts' stacked weights, mapped in these architectures only
EXPERT_TENSORS = frozenset({"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"})
EXPERT_ARCHITECTURES = frozenset({"qwen3moe", "olmoe"})
TOP_TENSORS = frozenset(
    {"token_embd", "output_norm", "output", "rope_freqs", "rope_factors_long", "rope_factors_short"}
)


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    """The few facts of a GGUF header that decide whether it can be served."""

    architecture: str  # general.architecture
    tensor_types: Mapping[str, str]  # each ggml type in the file -> one tensor of that type
    tokenizer: str | None  # tokenizer.ggml.model
    rope_scaling: str | None  # {arch}.rope.scaling.type, None when absent
    pre_tokenizer: str | None = None  # tokenizer.ggml.pre (a gpt2 vocabulary's split)
    unknown_tensor: str | None = None  # the first tensor whose name is no known_tensor


def listed(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def summary_of(header: GGUFHeader, type_names: Mapping[int, str]) -> GGUFSummary:
    """The summary of a scanned header (type_names: ggml type id -> name, gguf-py's)."""
    types: dict[str, str] = {}
    for name, type_id in header.tensor_types.items():
        types.setdefault(type_names.get(type_id, f"type {type_id}"), name)
    arch = str(header.values.get("general.architecture", ""))
    tokenizer = header.values.get("tokenizer.ggml.model")
    scaling = header.values.get(f"{arch}.rope.scaling.type")
    pre = header.values.get("tokenizer.ggml.pre")
    return GGUFSummary(architecture=arch, tensor_types=types,
                       tokenizer=None if tokenizer is None else str(tokenizer),
                       rope_scaling=None if scaling is None else str(scaling),
                       pre_tokenizer=None if pre is None else str(pre),
                       unknown_tensor=first_unknown(header.tensor_types, arch))  # fmt: skip


def known_tensor(name: str, arch: str = "") -> bool:
    """Whether the converter maps a tensor of this llama.cpp name in a file of `arch`."""
    base, _, _ = name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk":
        experts = arch in EXPERT_ARCHITECTURES and parts[-1] in EXPERT_TENSORS
        return len(parts) == 3 and (parts[2] in LAYER_TENSORS or experts)
    return base in TOP_TENSORS


def first_unknown(names: Iterable[str], arch: str = "") -> str | None:
    return next((n for n in names if not known_tensor(n, arch)), None)


def gguf_problem(summary: GGUFSummary) -> str | None:
    """Why a file with this header cannot be served (None: it can), naming what is missing."""
    arch = summary.architecture
    if arch not in ARCHITECTURES:
        return (f"its architecture {arch!r} is not one batchmlx loads from GGUF "
                f"({listed(ARCHITECTURES)})")  # fmt: skip
    unknown = sorted(set(summary.tensor_types) - TENSOR_TYPES)
    if unknown:
        first = unknown[0]
        return (f"its tensor type {first} ({summary.tensor_types[first]!r}"
                f"{' and others' if len(unknown) > 1 else ''}) is not one batchmlx reads "
                f"({listed(TENSOR_TYPES)})")  # fmt: skip
    if summary.unknown_tensor is not None:
        return (f"its tensor {summary.unknown_tensor!r} is not one batchmlx maps to a model "
                "(a mixture of experts' or another layer's)")  # fmt: skip
    if summary.tokenizer not in TOKENIZERS:
        return (f"its tokenizer {summary.tokenizer!r} is not one batchmlx reads "
                f"({listed(TOKENIZERS)})")  # fmt: skip
    pre = summary.pre_tokenizer or "default"
    if summary.tokenizer == "gpt2" and pre not in PRE_TOKENIZERS:
        return (f"its pre-tokenizer {pre!r} is not one batchmlx reads "
                f"({listed(PRE_TOKENIZERS)})")  # fmt: skip
    if summary.rope_scaling not in (None, *ROPE_SCALINGS):
        return (f"its RoPE scaling {summary.rope_scaling!r} is not one batchmlx applies "
                f"({listed(ROPE_SCALINGS)})")  # fmt: skip
    return None


# GGUF value types (gguf-py's GGUFValueType) -> struct format of one value; 8 string, 9 array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_MAGIC = b"GGUF"


class HeaderError(ValueError):
    """Not a GGUF header this reader knows (the message says what)."""


@dataclass
class GGUFHeader:
    """A GGUF header's scalar and string keys (arrays skipped) and its tensors' types."""

    values: dict[str, object] = field(default_factory=dict)
    tensor_types: dict[str, int] = field(default_factory=dict)  # name -> ggml type id


def scan_header(fh: BinaryIO) -> GGUFHeader:
    """The header of the GGUF file open in `fh` (binary, at its start). HeaderError where it is
    no GGUF (version 2 or 3) or ends early."""
    if fh.read(4) != _MAGIC:
        raise HeaderError("it does not start with GGUF's magic bytes")
    version = _unpack(fh, "<I")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} is not one this reader knows (2, 3)")
    n_tensors, n_kv = _unpack(fh, "<Q"), _unpack(fh, "<Q")
    header = GGUFHeader()
    for _ in range(int(n_kv)):
        key = _string(fh)
        kind = int(_unpack(fh, "<I"))
        if kind == _ARRAY:
            _skip_array(fh)
        else:
            header.values[key] = _value(fh, kind)
    for _ in range(int(n_tensors)):
        name = _string(fh)
        dims = int(_unpack(fh, "<I"))
        fh.read(8 * dims)
        header.tensor_types[name] = int(_unpack(fh, "<I"))
        fh.read(8)  # its offset
    return header


def _unpack(fh: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize(fmt)
    raw = fh.read(size)
    if len(raw) != size:
        raise HeaderError("the header ends early (a truncated file?)")
    value: int | float | bool = struct.unpack(fmt, raw)[0]
    return value


def _string(fh: BinaryIO) -> str:
    size = int(_unpack(fh, "<Q"))
    raw = fh.read(size)
    if len(raw) != size:
        raise HeaderError("the header ends early (a truncated file?)")
    return raw.decode("utf-8", errors="replace")


def _value(fh: BinaryIO, kind: int) -> object:
    if kind == _STRING:
        return _string(fh)
    if kind not in _SCALARS:
        raise HeaderError(f"unknown GGUF value type {kind}")
    return _unpack(fh, _SCALARS[kind])


def _skip_array(fh: BinaryIO) -> None:
    kind, count = int(_unpack(fh, "<I")), int(_unpack(fh, "<Q"))
    if kind == _STRING:
        for _ in range(count):
            fh.seek(int(_unpack(fh, "<Q")), 1)
    elif kind == _ARRAY:
        for _ in range(count):
            _skip_array(fh)
    elif kind in _SCALARS:
        fh.seek(count * struct.calcsize(_SCALARS[kind]), 1)
    else:
        raise HeaderError(f"unknown GGUF value type {kind}")
