"""The Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) rebuilt from a GGUF vocabulary: byte-level BPE (`gpt2`, with the
pre-tokenizer llama.cpp names) or SentencePiece (`llama`: scores and token types, as
transformers' LlamaTokenizerFast builds it), and the chat template from the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchmlx.core.gguf_support import PRE_TOKENIZERS
from batchmlx.engine.models.gguf.reader import GGUFConversionError

# llama.cpp pre-tokenizer names -> (split regex or None, split digits one by one).
_GPT2_REGEX = None  # ByteLevel's own GPT-2 regex
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
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
    "dbrx": (_LLAMA3_REGEX, False),
    "smaug-bpe": (_LLAMA3_REGEX, False),
    "qwen2": (_QWEN2_REGEX, False),
    "olmo": (_GPT2_REGEX, False),
}

assert set(_PRE_TOKENIZERS) == PRE_TOKENIZERS  # the names validation accepts

_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_SPACE = "\u2581"  # SentencePiece's word boundary


def write_tokenizer(meta: dict[str, Any], dest: Path, *, context_length: int) -> None:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, add_bos_default = _bpe(meta), False
    elif kind == "llama":
        tok, add_bos_default = _sentencepiece(meta), True
    else:
        raise GGUFConversionError(f"tokenizer model {kind!r} is not supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    _add_specials(tok, tokens, meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))

    def token_at(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    _post_process(tok, bos if add_bos else None, tokens, byte_level=kind == "gpt2")
    tok.save(str(dest / "tokenizer.json"))
    special_map = {
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    special_map = {k: v for k, v in special_map.items() if v is not None}
    _write_tokenizer_config(meta, dest, special_map, add_bos, context_length)


def _bpe(meta: dict[str, Any]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre_name = meta.get("tokenizer.ggml.pre", "default")
    if pre_name not in _PRE_TOKENIZERS:
        raise GGUFConversionError(f"GGUF pre-tokenizer {pre_name!r} is not supported")
    split_regex, split_digits = _PRE_TOKENIZERS[pre_name]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    steps: list[Any] = []
    if split_digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if split_regex is not None:
        steps.append(pre_tokenizers.Split(Regex(split_regex), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_regex is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's scores (as transformers derives them): every
    split of a piece into two pieces, ranked by the whole piece's score, best first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]  # fmt: skip
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((-score, n, lr) for n, lr in enumerate(local, start=len(ranked)))
    ranked.sort(key=lambda r: (r[0], r[1]))
    return [lr for _, _, lr in ranked]


def _sentencepiece(meta: dict[str, Any]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unk = next((t for t, ty in zip(tokens, types, strict=True) if ty == _TOKEN_TYPE_UNKNOWN), None)
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))  # fmt: skip
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    decode = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        decode.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _add_specials(tok: Any, tokens: list[str], token_types: list[int]) -> None:
    from tokenizers import AddedToken

    specials = [
        AddedToken(t, special=ty == _TOKEN_TYPE_CONTROL, normalized=False)
        for t, ty in zip(tokens, token_types, strict=True)
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens([t for t in specials if t.special])
    tok.add_tokens([t for t in specials if not t.special])


def _post_process(tok: Any, bos: str | None, tokens: list[str], *, byte_level: bool) -> None:
    from tokenizers import processors

    steps: list[Any] = []
    if byte_level:
        steps.append(processors.ByteLevel(add_prefix_space=False, trim_offsets=False))
    if bos is not None:
        steps.append(processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tokens.index(bos))],
        ))  # fmt: skip
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)


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
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    _write_json(dest / "special_tokens_map.json", special_map)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
