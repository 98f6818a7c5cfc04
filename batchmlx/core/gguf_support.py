"""What a GGUF file must hold for batchmlx to serve it: its architecture, its tensor types, its
tokenizer and RoPE scaling. Pure: the caller reads the file's header (batches/models.py at
validation, engine/models/gguf when converting) and both judge it here, so a file refused at
submit time is the file the converter would refuse, with the same message."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

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
}
# ggml tensor types dequantized on load (gguf-py's numpy code); the names are GGMLQuantizationType's
TENSOR_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
     "Q6_K"}
)  # fmt: skip
TOKENIZERS = frozenset({"gpt2", "llama"})  # BPE (byte-level) and SentencePiece
ROPE_SCALINGS = frozenset({"none", "linear", "yarn"})  # llama3's comes as a rope_freqs tensor


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    """The few facts of a GGUF header that decide whether it can be served."""

    architecture: str  # general.architecture
    tensor_types: Mapping[str, str]  # each ggml type in the file -> one tensor of that type
    tokenizer: str | None  # tokenizer.ggml.model
    rope_scaling: str | None  # {arch}.rope.scaling.type, None when absent


def listed(names: object) -> str:
    return ", ".join(sorted(str(n) for n in names))  # type: ignore[attr-defined]


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
    if summary.tokenizer not in TOKENIZERS:
        return (f"its tokenizer {summary.tokenizer!r} is not one batchmlx reads "
                f"({listed(TOKENIZERS)})")  # fmt: skip
    if summary.rope_scaling not in (None, *ROPE_SCALINGS):
        return (f"its RoPE scaling {summary.rope_scaling!r} is not one batchmlx applies "
                f"({listed(ROPE_SCALINGS)})")  # fmt: skip
    return None
