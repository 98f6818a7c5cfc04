"""Convert a llama-architecture GGUF file into an MLX model folder that `mlx_lm.load` reads.

MLX's GGUF reader already hands back Q4_0/Q4_1/Q8_0 tensors as MLX affine-quantized triples
(`weight` uint32, `scales`, `biases`), so conversion is renaming plus writing the config and a
Hugging Face tokenizer rebuilt from the GGUF vocabulary.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx

from batchmlx.engine.models.first_run import disk_use, note, size_text, wrote

MARKER_NAME = ".batchmlx-converted.json"
# Bump when the output layout changes so old conversions are redone.
CONVERTER_VERSION = 1

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp pre-tokenizer names -> (split regex or None, split digits one by one).
_GPT2_REGEX = None  # ByteLevel's own GPT-2 regex
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (_GPT2_REGEX, False),
    "gpt-2": (_GPT2_REGEX, False),
    "smollm": (_GPT2_REGEX, True),
    "starcoder": (_GPT2_REGEX, True),
    "refact": (_GPT2_REGEX, True),
    "llama-bpe": (_LLAMA3_REGEX, False),
    "llama3": (_LLAMA3_REGEX, False),
}

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


class GGUFConversionError(ValueError):
    """The GGUF file uses an architecture or tokenizer this converter does not handle."""


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock across processes (another worker may be converting the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into `out_dir` once; later calls reuse the folder if the source is
    unchanged (same size and mtime). The folder appears atomically, fully written or not at all."""
    gguf_path = Path(gguf_path).resolve()
    st = gguf_path.stat()
    stamp = {
        "source": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "converter_version": CONVERTER_VERSION,
    }
    keys = ("size", "mtime_ns", "converter_version")
    what = f"converting {gguf_path.name} ({size_text(st.st_size)}) into an MLX model folder, once"
    return build_folder_once(
        Path(out_dir), stamp, keys, lambda tmp: _write_model_folder(gguf_path, tmp), what=what
    )


def build_folder_once(
    out_dir: Path,
    stamp: dict[str, Any],
    keys: tuple[str, ...],
    write: Callable[[Path], None],
    *,
    what: str = "writing",
) -> Path:
    """`out_dir`, written by `write(tmp)` unless its marker already holds `stamp`'s `keys`.
    Written under a file lock (another process may be building it), into a temp folder that
    replaces any stale one atomically: readers see the old folder or the complete new one.
    A build is told (notes.py): `what`, where, then its size and time."""
    if _is_built(out_dir, stamp, keys):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if _is_built(out_dir, stamp, keys):
            return out_dir
        note("%s: %s ...", what, out_dir)
        t0 = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            write(tmp)
            (tmp / MARKER_NAME).write_text(json.dumps(stamp, indent=2))
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            if out_dir.exists():  # a stale build of an older source
                shutil.rmtree(out_dir)
            os.replace(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        wrote()
        note("wrote %s (%s) in %.1fs", out_dir.name, size_text(disk_use(out_dir)),
             time.monotonic() - t0)  # fmt: skip
    return out_dir


def read_marker(folder: Path) -> dict[str, Any] | None:
    """The stamp a folder built by `build_folder_once` was written with, or None."""
    try:
        saved = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def _is_built(out_dir: Path, stamp: dict[str, Any], keys: tuple[str, ...]) -> bool:
    saved = read_marker(out_dir)
    return saved is not None and all(saved.get(k) == stamp[k] for k in keys)


def _write_model_folder(gguf_path: Path, dest: Path) -> None:
    weights, meta = mx.load(str(gguf_path), return_metadata=True)
    arch = _scalar(meta.get("general.architecture", ""))
    if arch != "llama":
        raise GGUFConversionError(f"{gguf_path.name}: architecture {arch!r} is not supported")
    weights = _rename_weights(weights)
    config = _model_config(meta, weights)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(dest / "config.json", config)
    _write_tokenizer(meta, dest, context_length=config["max_position_embeddings"])
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(dest / "generation_config.json", gen)


def _scalar(value: Any) -> Any:
    # GGUF scalars arrive as 0-d mx arrays; strings and lists as Python objects.
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def _rename_weights(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    renamed = {}
    for key, value in weights.items():
        base, _, suffix = key.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            new_base = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
        elif base in _TOP_NAMES:
            new_base = _TOP_NAMES[base]
        else:
            raise GGUFConversionError(f"unexpected GGUF tensor {key!r}")
        renamed[f"{new_base}.{suffix}"] = value
    return renamed


def _model_config(meta: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return _scalar(meta.get(f"llama.{key}", default))

    if get("rope.scaling.type", "none") not in ("none", None):
        raise GGUFConversionError("GGUF rope scaling is not supported yet")
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        # llama.cpp permutes Q/K rows for interleaved (GPT-J style) rotary embeddings.
        "rope_traditional": True,
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    for name in ("bos", "eos", "padding"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in meta:
            field = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[field] = int(_scalar(meta[key]))
    quantization = _quantization_config(config, weights)
    if quantization:
        config["quantization"] = quantization
    return config


def _in_features(path: str, config: dict[str, Any]) -> int:
    if path.endswith("o_proj"):
        return config["num_attention_heads"] * config["head_dim"]
    if path.endswith("down_proj"):
        return config["intermediate_size"]
    return config["hidden_size"]


def _quantization_config(config: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, Any]:
    """Per-layer quantization: GGUF files mix bit widths (e.g. a Q8_0 embedding next to Q4_1
    layers), and mlx-lm looks each module path up in this dict before using the defaults."""
    per_layer: dict[str, Any] = {}
    for key, w in weights.items():
        if not key.endswith(".weight") or w.ndim != 2:
            continue
        path = key[: -len(".weight")]
        scales = weights.get(f"{path}.scales")
        if scales is None:
            per_layer[path] = False  # stored unquantized (e.g. float16): keep it a plain layer
            continue
        in_features = _in_features(path, config)
        per_layer[path] = {
            "group_size": in_features // scales.shape[-1],
            "bits": w.shape[-1] * 32 // in_features,
            "mode": "affine",
        }
    params = [p for p in per_layer.values() if p]
    if not params:
        return {}
    group_size, bits = Counter((p["group_size"], p["bits"]) for p in params).most_common(1)[0][0]
    default = {"group_size": group_size, "bits": bits, "mode": "affine"}
    # Name only the layers that differ from the default, which keeps config.json readable.
    return default | {path: p for path, p in sorted(per_layer.items()) if p != default}


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(meta: dict[str, Any], dest: Path, *, context_length: int) -> None:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = _scalar(meta.get("tokenizer.ggml.model"))
    if kind != "gpt2":
        raise GGUFConversionError(f"tokenizer model {kind!r} is not supported (only gpt2 BPE)")
    pre_name = _scalar(meta.get("tokenizer.ggml.pre", "default"))
    if pre_name not in _PRE_TOKENIZERS:
        raise GGUFConversionError(f"GGUF pre-tokenizer {pre_name!r} is not supported")
    split_regex, split_digits = _PRE_TOKENIZERS[pre_name]

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    token_types = _scalar(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps: list[Any] = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split_regex is not None:
        steps.append(pre_tokenizers.Split(Regex(split_regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_regex is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()

    specials = [
        AddedToken(t, special=ty == _TOKEN_TYPE_CONTROL, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([t for t in specials if t.special])
    tok.add_tokens([t for t in specials if not t.special])

    def token_at(key: str) -> str | None:
        full = f"tokenizer.ggml.{key}"
        return tokens[int(_scalar(meta[full]))] if full in meta else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(_scalar(meta.get("tokenizer.ggml.add_bos_token", False)))
    byte_level = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    if add_bos and bos is not None:
        bos_id = vocab[bos]
        template = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
        tok.post_processor = processors.Sequence([byte_level, template])
    else:
        tok.post_processor = byte_level
    tok.save(str(dest / "tokenizer.json"))

    special_map = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    special_map = {k: v for k, v in special_map.items() if v is not None}
    _write_tokenizer_config(meta, dest, special_map, add_bos, context_length)


def _write_tokenizer_config(
    meta: dict[str, Any], dest: Path, special_map: dict[str, str], add_bos: bool,
    context_length: int,
) -> None:  # fmt: skip
    """tokenizer_config.json and special_tokens_map.json, next to tokenizer.json."""
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        # Decoding must give back exactly what was encoded (no " ." -> "." cleanup).
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = _scalar(meta.get("tokenizer.chat_template"))
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    _write_json(dest / "special_tokens_map.json", special_map)


def looks_like_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
