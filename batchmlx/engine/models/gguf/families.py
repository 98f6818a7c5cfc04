"""Each GGUF architecture as the mlx-lm model that runs it: the config.json its metadata gives,
and its tensors under the Hugging Face names mlx-lm loads, undoing what llama.cpp's
convert_hf_to_gguf.py did to them (q/k rows permuted for its interleaved RoPE; Gemma's norms
stored as 1 + w). Pure: names, shapes and numpy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from batchmlx.core.gguf_support import ARCHITECTURES, EXPERT_TENSORS, LAYER_TENSORS, TOP_TENSORS
from batchmlx.engine.models.gguf import rope
from batchmlx.engine.models.gguf.reader import GGUFConversionError, GGUFFile

# llama.cpp's per-layer tensor names -> mlx-lm's module paths, for every family
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # a mixture of experts (qwen3moe, olmoe): the router, and each weight of every expert
    # stacked [experts, rows, columns], as mlx-lm's SwitchGLU holds them
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# tensors that are settings, not weights: read into the config
_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")
# the names validation accepts (core/gguf_support) are the names mapped here
assert set(_LAYER_NAMES) == LAYER_TENSORS | EXPERT_TENSORS
assert {*_TOP_NAMES, *_CONFIG_TENSORS} == TOP_TENSORS


class Transform(Enum):
    """What a tensor needs before mlx-lm reads it."""

    NONE = "none"
    UNPERMUTE_Q = "unpermute_q"  # llama.cpp's q/k row permutation, undone
    UNPERMUTE_K = "unpermute_k"
    MINUS_ONE = "minus_one"  # Gemma's norms: llama.cpp stores 1 + w


@dataclass(frozen=True, slots=True)
class Family:
    """How one architecture differs from llama's layout."""

    # mlx-lm's rotation is on halves, llama.cpp permuted q/k for its pairwise one: undo it (llama
    # itself keeps the permuted rows with rope_traditional, as batchmlx always loaded it)
    unpermute_qk: bool = False
    norms_plus_one: bool = False  # Gemma
    renames: dict[str, str] = field(default_factory=dict)  # per-layer names that differ
    extra: Callable[[GGUFFile, dict[str, Any]], dict[str, Any]] = lambda f, c: {}


def _llama(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    return {"rope_traditional": True, **_biases(f)}


def _biases(f: GGUFFile) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in f.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in f.tensors}  # fmt: skip


def _gemma_scalar(f: GGUFFile, c: dict[str, Any], big_layers: int) -> int:
    # llama.cpp scales the 27B's queries by hidden/heads, the others' by head_dim (an int:
    # transformers' config class checks the type)
    if c["num_hidden_layers"] == big_layers:
        return c["hidden_size"] // c["num_attention_heads"]
    return int(c["head_dim"])


def _gemma2(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    return {
        "attn_logit_softcapping": float(f.get("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(f.get("final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _gemma_scalar(f, c, 46),
    }


def _gemma3(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    return {
        "sliding_window": int(f.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,  # llama.cpp's, not in the file
        "rope_local_base_freq": float(f.get("rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": _gemma_scalar(f, c, 62),
    }


def _phi3(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    rot = int(f.get("rope.dimension_count", c["head_dim"]))
    out: dict[str, Any] = {
        "partial_rotary_factor": rot / c["head_dim"],
        "original_max_position_embeddings": int(
            f.get("rope.scaling.original_context_length", c["max_position_embeddings"])
        ),
    }
    long, short = (f.tensors.get(f"rope_factors_{k}.weight") for k in ("long", "short"))
    if long is not None and short is not None:
        factors = {
            k: np.asarray(t.raw, np.float32).tolist()
            for k, t in (("long_factor", long), ("short_factor", short))
        }
        out["rope_scaling"] = {"type": "longrope", **factors}
    return out


def _granite(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_multiplier": float(f.get("attention.scale", 1.0)),
        "embedding_multiplier": float(f.get("embedding_scale", 1.0)),
        "residual_multiplier": float(f.get("residual_scale", 1.0)),
        "logits_scaling": float(f.get("logit_scale", 1.0)),
        **_biases(f),
    }


def _smollm3(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's smollm3 leaves RoPE out of every 4th layer (not in the file)
    return {"no_rope_layer_interval": 4, **_biases(f)}


def _experts(f: GGUFFile, norm_topk_prob: bool) -> dict[str, Any]:
    """A mixture of experts' counts; whether its top-k weights are renormalized is the file's
    expert_weights_norm where written, else what llama.cpp's graph for the architecture does."""
    return {
        "num_experts": int(f.get("expert_count")),
        "num_experts_per_tok": int(f.get("expert_used_count")),
        "norm_topk_prob": bool(f.get("expert_weights_norm", norm_topk_prob)),
    }


def _qwen3moe(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    # every layer a mixture of experts, as llama.cpp builds it
    ff = f.get("expert_feed_forward_length", c["intermediate_size"])
    return {**_experts(f, True), "moe_intermediate_size": int(ff), "decoder_sparse_step": 1,
            "mlp_only_layers": []}  # fmt: skip


def _olmoe(f: GGUFFile, c: dict[str, Any]) -> dict[str, Any]:
    # mlx-lm's olmoe sizes its experts by intermediate_size
    ff = f.get("expert_feed_forward_length", c["intermediate_size"])
    return {**_experts(f, False), "intermediate_size": int(ff)}


FAMILIES: dict[str, Family] = {
    "llama": Family(extra=_llama),
    "qwen2": Family(),
    "qwen3": Family(),
    "gemma2": Family(
        norms_plus_one=True, renames={"ffn_norm": "pre_feedforward_layernorm"}, extra=_gemma2
    ),  # fmt: skip
    "gemma3": Family(
        norms_plus_one=True, renames={"ffn_norm": "pre_feedforward_layernorm"}, extra=_gemma3
    ),  # fmt: skip
    "phi3": Family(renames={"ffn_up": "mlp.gate_up_proj"}, extra=_phi3),
    "granite": Family(unpermute_qk=True, extra=_granite),
    "olmo2": Family(),
    "smollm3": Family(unpermute_qk=True, extra=_smollm3),
    "qwen3moe": Family(extra=_qwen3moe),
    "olmoe": Family(extra=_olmoe),
}
assert set(FAMILIES) == set(ARCHITECTURES)


def family_of(f: GGUFFile) -> Family:
    family = FAMILIES.get(f.arch)
    if family is None:
        raise GGUFConversionError(f"architecture {f.arch!r} is not supported")
    return family


def model_config(f: GGUFFile) -> dict[str, Any]:
    """The config.json mlx-lm builds this file's model from."""
    family = family_of(f)
    hidden = int(f.get("embedding_length"))
    n_heads = int(f.get("attention.head_count"))
    n_kv = f.get("attention.head_count_kv", n_heads)
    embed = f.tensors["token_embd.weight"]
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[f.arch],
        "hidden_size": hidden,
        # (a mixture of experts' file may size only its experts)
        "intermediate_size": int(f.get("feed_forward_length", f.get("expert_feed_forward_length"))),
        "num_hidden_layers": int(f.get("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
        "head_dim": int(f.get("attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(f.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(f.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get("context_length", 2048)),
        "vocab_size": int(embed.shape[0]),
        "tie_word_embeddings": "output.weight" not in f.tensors,
    }
    scaling = _rope_scaling(f, config)
    if scaling is not None:
        config["rope_scaling"] = scaling
    config.update(family.extra(f, config))
    for name in ("bos", "eos", "padding"):
        value = f.meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(value)
    return config


def _rope_scaling(f: GGUFFile, config: dict[str, Any]) -> dict[str, Any] | None:
    freqs = f.tensors.get("rope_freqs.weight")
    if freqs is not None:
        dims = int(f.get("rope.dimension_count", config["head_dim"]))
        return rope.llama3_from_factors(np.asarray(freqs.raw, np.float32), config["rope_theta"],
                                        dims)  # fmt: skip
    return rope.from_keys(f.get)


@dataclass(frozen=True, slots=True)
class Placed:
    """A GGUF tensor's name in the MLX folder, and what it needs on the way."""

    source: str
    target: str
    transform: Transform


def placements(f: GGUFFile) -> list[Placed]:
    """Every weight of the file under its mlx-lm name (GGUFConversionError names an unknown one)."""
    family = family_of(f)
    layer_names = _LAYER_NAMES | family.renames
    out = []
    for key in f.tensors:
        base, _, suffix = key.rpartition(".")
        parts = base.split(".")
        if parts[0] in _CONFIG_TENSORS:
            continue
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
            target = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
        elif base in _TOP_NAMES:
            target = f"{_TOP_NAMES[base]}.{suffix}"
        else:
            raise GGUFConversionError(f"unexpected GGUF tensor {key!r} for {f.arch!r}")
        out.append(Placed(key, target, _transform(family, parts[-1], suffix)))
    return out


def _transform(family: Family, short: str, suffix: str) -> Transform:
    if family.unpermute_qk and short in ("attn_q", "attn_k"):
        return Transform.UNPERMUTE_Q if short == "attn_q" else Transform.UNPERMUTE_K
    if family.norms_plus_one and short.endswith("norm") and suffix == "weight":
        return Transform.MINUS_ONE
    return Transform.NONE


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute (rows of each head
    interleaved as pairs, back to halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)  # fmt: skip
