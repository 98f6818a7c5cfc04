"""GGUF files (llama.cpp's format) as MLX model folders: reader.py (gguf-py: header, tensors
dequantized in numpy), families.py (each architecture's config and tensor names for mlx-lm),
rope.py (RoPE scaling), tokenizer.py (BPE and SentencePiece vocabularies), weights.py (the
safetensors written a tensor at a time), folder.py (the conversion, once and atomically)."""

from batchmlx.engine.models.gguf.folder import (
    CONVERTER_VERSION,
    MARKER_NAME,
    build_folder_once,
    convert_gguf,
    file_lock,
    looks_like_gguf,
    read_marker,
)
from batchmlx.engine.models.gguf.reader import GGUFConversionError

__all__ = [
    "CONVERTER_VERSION",
    "MARKER_NAME",
    "GGUFConversionError",
    "build_folder_once",
    "convert_gguf",
    "file_lock",
    "looks_like_gguf",
    "read_marker",
]
