"""Tiny random GGUF files of each family, written as llama.cpp's convert_hf_to_gguf.py writes
them: from a random mlx-lm model of that family, tensor names from gguf-py's own TensorNameMap
(llama.cpp's table, not batchmlx's), metadata through GGUFWriter's add_* methods, q/k rows
permuted for the architectures llama.cpp ropes pairwise, Gemma's norms stored as 1 + w; and a
tiny byte-level BPE vocabulary (262 tokens, a chat template)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 262
BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Case:
    """One family: its GGUF architecture, the mlx-lm config, and its own metadata keys."""

    arch: str  # general.architecture
    config: dict[str, Any]
    permuted: bool = False  # llama.cpp's pairwise RoPE: q/k rows permuted by the converter
    plus_one: bool = False  # Gemma
    keys: Callable[[Any, dict[str, Any]], None] = lambda w, c: None
    extra: dict[str, Any] = field(default_factory=dict)


def _gemma2_keys(w: Any, c: dict[str, Any]) -> None:
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(4096)


def _gemma3_keys(w: Any, c: dict[str, Any]) -> None:
    w.add_sliding_window(c["sliding_window"])


def _granite_keys(w: Any, c: dict[str, Any]) -> None:
    w.add_attention_scale(c["attention_multiplier"])
    w.add_embedding_scale(c["embedding_multiplier"])
    w.add_residual_scale(c["residual_multiplier"])
    w.add_logit_scale(c["logits_scaling"])


def _phi3_keys(w: Any, c: dict[str, Any]) -> None:
    w.add_rope_dimension_count(int(c["head_dim"] * c.get("partial_rotary_factor", 1.0)))


def _expert_keys(w: Any, c: dict[str, Any]) -> None:
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(c.get("moe_intermediate_size", c["intermediate_size"]))


# 4 experts, 2 a token (every layer a mixture, as llama.cpp builds these)
_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2}
CASES = {
    "llama": Case("llama", {"model_type": "llama", **BASE, "tie_word_embeddings": False},
                  permuted=True),
    "qwen2": Case("qwen2", {"model_type": "qwen2", **BASE}),
    "qwen3": Case("qwen3", {"model_type": "qwen3", **BASE}),
    "gemma2": Case("gemma2", {"model_type": "gemma2", **BASE, "attn_logit_softcapping": 50.0,
                              "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16},
                   plus_one=True, keys=_gemma2_keys),
    "gemma3": Case("gemma3", {"model_type": "gemma3_text", **BASE, "sliding_window": 8,
                              "num_hidden_layers": 6,  # mlx-lm needs one global layer
                              "sliding_window_pattern": 6, "query_pre_attn_scalar": 16,
                              "rope_theta": 1e6, "rope_local_base_freq": 10000.0},
                   plus_one=True, keys=_gemma3_keys),
    "phi3": Case("phi3", {"model_type": "phi3", **BASE, "tie_word_embeddings": False,
                          "partial_rotary_factor": 0.75}, keys=_phi3_keys),
    "granite": Case("granite", {"model_type": "granite", **BASE, "attention_multiplier": 0.2,
                                "embedding_multiplier": 6.0, "residual_multiplier": 0.5,
                                "logits_scaling": 4.0, "attention_bias": False,
                                "mlp_bias": False}, permuted=True, keys=_granite_keys),
    "olmo2": Case("olmo2", {"model_type": "olmo2", **BASE, "tie_word_embeddings": False}),
    "smollm3": Case("smollm3", {"model_type": "smollm3", **BASE, "num_hidden_layers": 4,
                                "no_rope_layer_interval": 4}, permuted=True),
    "qwen3moe": Case("qwen3moe", {"model_type": "qwen3_moe", **BASE, **_EXPERTS,
                                  "moe_intermediate_size": 48, "norm_topk_prob": True,
                                  "decoder_sparse_step": 1, "mlp_only_layers": []},
                     keys=_expert_keys),
    "olmoe": Case("olmoe", {"model_type": "olmoe", **BASE, **_EXPERTS, "norm_topk_prob": False},
                  keys=_expert_keys),
}  # fmt: skip


def random_model(config: dict[str, Any], seed: int = 0) -> Any:
    """A random mlx-lm model of `config`, norms away from 1 so they matter."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    params = dict(tree_flatten(model.parameters()))
    for key, value in params.items():
        if key.endswith("norm.weight"):
            params[key] = 0.5 + mx.random.uniform(shape=value.shape)
        elif value.ndim == 2:  # mlx-lm's init is small for a 2-layer model: make it decisive
            params[key] = value * 4
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)  # fmt: skip


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _tokenizer(w: Any) -> None:
    chars = _bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = ["\u0120t", "he", "\u0120the"]
    tokens = [chars[b] for b in range(256)] + words + specials
    assert len(tokens) == VOCAB
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 3) + [3] * 3)
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    w.add_bos_token_id(VOCAB - 3)
    w.add_eos_token_id(VOCAB - 1)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def hf_weights(model: Any) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    return {k: np.array(v.astype(__import__("mlx.core").core.float32))
            for k, v in tree_flatten(model.parameters())}  # fmt: skip


def write_gguf(path: Path, case: Case, weights: dict[str, np.ndarray],
               quantize: Callable[[str, np.ndarray], tuple[np.ndarray, Any] | None] | None = None,
               extra_keys: Callable[[Any], None] | None = None,
               architecture: str | None = None,
               tokenizer: Callable[[Any], None] | None = None) -> Path:  # fmt: skip
    """`weights` (mlx-lm names, float32) written as llama.cpp would write them. quantize: name,
    array -> (raw bytes, GGMLQuantizationType) for the tensors to store quantized, else None.
    architecture: the general.architecture written instead of the case's. tokenizer: writes
    the vocabulary's keys (default: the tiny byte-level BPE)."""
    import gguf

    c = case.config
    n = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[case.arch.upper()], n)
    w = gguf.GGUFWriter(str(path), architecture or case.arch)
    w.add_block_count(n)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    case.keys(w, c)
    if extra_keys is not None:
        extra_keys(w)
    (tokenizer or _tokenizer)(w)
    for key, value in weights.items():
        base, _, suffix = key.rpartition(".")
        # mlx-lm's stacked experts are llama.cpp's (HF's experts.N stacked by the converter)
        name = names.get_name(base.replace(".switch_mlp.", ".experts."))
        assert name is not None, key
        if case.permuted and name.endswith(("attn_q", "attn_k")):
            heads = c["num_attention_heads"] if name.endswith("q") else c["num_key_value_heads"]
            value = permute(value, heads)
        if case.plus_one and name.endswith("norm"):
            value = value + np.float32(1.0)
        stored = quantize(f"{name}.{suffix}", value) if quantize else None
        if stored is None:
            w.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(value, dtype=np.float32))
        else:
            raw, qtype = stored
            w.add_tensor(f"{name}.{suffix}", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
