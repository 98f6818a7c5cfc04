"""What a model family's blocks differ in, as the host step (engine/host/step.py) composes them:
one frozen `Family` read from an mlx-lm model instance by `describe`.

Most parts are read from the instance itself: which projections exist (q, k, v or phi3's fused
qkv_proj; gate and up or its gate_up_proj), q/k norms and their width (per head: qwen3, gemma3;
over all heads: olmo2), each layer's RoPE (plain, linear, llama3, yarn, su; none: smollm3's NoPE
layers) and attention scale, and each layer's sliding window (the RotatingKVCache mlx-lm makes
for it). What only the family's forward code says (where the norms sit, gemma's 1 + w norm
weight, its GeGLU, the embedding, residual and logit factors, soft-capping, whether its MLPs
may be mixtures of experts) is written once per mlx-lm module in `CODE`, each entry checked
against mlx-lm's own models/<family>.py. A mixture of experts' routing (experts, top k,
renormalized or not) and which layers have one are read from the instance. A module not in
`CODE` keeps the MLX path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from batchmlx.engine.host.linear import HostExperts
from batchmlx.engine.host.rope import HostRope, NotCovered, rope_of


class Activation(enum.Enum):
    """The gated MLP's activation of its gate half."""

    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"  # GeGLU with gelu's tanh approximation (gemma: nn.gelu_approx)


class QKNorm(enum.Enum):
    """RMSNorm of the queries and keys before RoPE."""

    NONE = "none"
    HEAD = "head"  # over each head's head_dim (qwen3, gemma3)
    ALL = "all"  # over all heads at once, n_heads x head_dim wide (olmo2)


@dataclass(frozen=True, slots=True)
class Norms:
    """A block's RMSNorm attributes by where they sit (None: there is none)."""

    pre_attn: str | None  # on the block's input, before attention
    post_attn: str | None  # on the attention's output, before the residual add (gemma, olmo2)
    pre_mlp: str | None  # on the residual stream, before the MLP
    post_mlp: str | None  # on the MLP's output, before the residual add (gemma, olmo2)


LLAMA_NORMS = Norms("input_layernorm", None, "post_attention_layernorm", None)
GEMMA_NORMS = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")  # fmt: skip
OLMO2_NORMS = Norms(None, "post_attention_layernorm", None, "post_feedforward_layernorm")


@dataclass(frozen=True, slots=True)
class Code:
    """What one mlx-lm module's forward code does beyond llama's, that no attribute says."""

    norms: Norms = LLAMA_NORMS
    norm_offset: float = 0.0  # RMSNorm weights taken as offset + w (gemma: 1 + w)
    activation: Activation = Activation.SILU
    # embedding rows times this, from the model (gemma: sqrt(hidden), granite's multiplier)
    embed_scale: Callable[[Any], float] | None = None
    residual_scale: str | None = None  # args field: each sublayer's output times it (granite)
    logit_divisor: str | None = None  # args field: logits divided by it (granite)
    attn_softcap: str | None = None  # args field: scores -> cap * tanh(scores / cap) (gemma2)
    final_softcap: str | None = None  # args field: the same on the logits (gemma2)
    layer_module: str | None = None  # the blocks' module, where not the model's (smollm3)
    # its MLPs may be mixtures of experts (`mlp.gate` the router, `mlp.switch_mlp` a SwitchGLU),
    # routed as Routing says (qwen3_moe, olmoe)
    experts: bool = False


def _gemma3_embed_scale(model: Any) -> float:
    # gemma3_text multiplies by sqrt(hidden) rounded to bf16 first
    return float(mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(mx.float32).item())


def _gemma2_embed_scale(model: Any) -> float:
    return float(model.args.hidden_size**0.5)


def _granite_embed_scale(model: Any) -> float:
    return float(model.args.embedding_multiplier)


_GEMMA = dict(norms=GEMMA_NORMS, norm_offset=1.0, activation=Activation.GELU_TANH)
CODE: dict[str, Code] = {
    "mlx_lm.models.llama": Code(),  # (mistral is mlx-lm's llama)
    "mlx_lm.models.qwen2": Code(),
    "mlx_lm.models.qwen3": Code(),
    "mlx_lm.models.phi3": Code(),
    "mlx_lm.models.smollm3": Code(layer_module="mlx_lm.models.llama"),
    "mlx_lm.models.gemma3_text": Code(**_GEMMA, embed_scale=_gemma3_embed_scale),
    "mlx_lm.models.gemma2": Code(
        **_GEMMA,
        embed_scale=_gemma2_embed_scale,
        attn_softcap="attn_logit_softcapping",
        final_softcap="final_logit_softcapping",
    ),  # fmt: skip
    "mlx_lm.models.granite": Code(
        embed_scale=_granite_embed_scale,
        residual_scale="residual_multiplier",
        logit_divisor="logits_scaling",
    ),  # fmt: skip
    "mlx_lm.models.olmo2": Code(norms=OLMO2_NORMS),
    "mlx_lm.models.qwen3_moe": Code(experts=True),
    "mlx_lm.models.olmoe": Code(experts=True),  # (its q/k norms over all heads, as olmo2's)
}


@dataclass(frozen=True, slots=True)
class Routing:
    """A mixture-of-experts MLP's routing, as qwen3_moe's and olmoe's blocks compute it: the
    router's logits, softmax over all experts in float32, each token's top_k, their weights
    renormalized to sum 1 where norm_topk_prob (Qwen3-MoE: yes, OLMoE: no); the MLP's output
    the weighted sum of those experts' SwiGLU MLPs. No shared experts (qwen2_moe's)."""

    experts: int
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """What differs between one model's layers."""

    rope: HostRope | None  # None: no RoPE in this layer (smollm3)
    window: int | None  # keys seen: the last `window` (sliding-window layers), None: all


@dataclass(frozen=True, slots=True)
class Family:
    """A model's block shape, as the host step composes it (see the module doc)."""

    name: str  # mlx-lm's module, e.g. "mlx_lm.models.qwen3"
    qkv: tuple[str, ...]  # the attention's input projections: q, k, v or one fused qkv
    gate_up: tuple[str, ...]  # the MLP's: gate, up or one fused gate_up
    norms: Norms
    norm_offset: float
    qk_norm: QKNorm
    activation: Activation
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float  # of the queries (mlx-lm's attention `scale`)
    layers: tuple[LayerAttention, ...]
    embed_scale: float | None = None
    residual_scale: float | None = None
    logit_divisor: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    routing: Routing | None = None  # its mixtures of experts' (None: every MLP is dense)
    expert_layers: frozenset[int] = frozenset()  # the layers whose MLP is one

    @property
    def windows(self) -> frozenset[int]:
        """The sliding windows of its layers (empty: every layer sees every key)."""
        return frozenset(w.window for w in self.layers if w.window is not None)


def describe(model: nn.Module) -> Family | str:
    """The Family of an mlx-lm model instance, or why the host step does not cover it."""
    name = type(model).__module__
    code = CODE.get(name)
    if code is None:
        return f"architecture {name}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers:
        return "no model.layers"
    args = getattr(model, "args", None)
    block_module = code.layer_module or name
    try:
        windows = _windows(model)
        first = _attention_shape(layers[0].self_attn)
        per_layer = []
        for layer in layers:
            if type(layer).__module__ != block_module or type(layer.self_attn).__module__ != (
                block_module
            ):
                return f"block {type(layer).__module__}.{type(layer).__name__} in {name}"
            attn = layer.self_attn
            if _attention_shape(attn) != first:
                return "blocks of different shapes"
            n_heads, n_kv, head_dim, _ = first
            per_layer.append(rope_of(attn.rope, head_dim, n_heads + n_kv))
        routing, expert_layers = _experts(layers, code)
        dense = next((la for i, la in enumerate(layers) if i not in expert_layers), None)
        qkv, gate_up = _projections(layers[0], dense)
        qk_norm = _qk_norm(layers[0].self_attn, first[2])
        _check_norms(inner, layers, code)
    except NotCovered as exc:
        return str(exc)

    def arg(field: str | None) -> float | None:
        return None if field is None else float(getattr(args, field))

    n_heads, n_kv, head_dim, scale = first
    return Family(
        name=name, qkv=qkv, gate_up=gate_up, norms=code.norms, norm_offset=code.norm_offset,
        qk_norm=qk_norm, activation=code.activation, n_heads=n_heads, n_kv_heads=n_kv,
        head_dim=head_dim, scale=scale,
        layers=tuple(LayerAttention(r, w) for r, w in zip(per_layer, windows, strict=True)),
        embed_scale=None if code.embed_scale is None else code.embed_scale(model),
        residual_scale=arg(code.residual_scale), logit_divisor=arg(code.logit_divisor),
        attn_softcap=arg(code.attn_softcap), final_softcap=arg(code.final_softcap),
        routing=routing, expert_layers=expert_layers,
    )  # fmt: skip


def _attention_shape(attn: nn.Module) -> tuple[int, int, int, float]:
    """(query heads, KV heads, head_dim, scale) of an attention module."""
    n_heads, n_kv = int(attn.n_heads), int(attn.n_kv_heads)
    head_dim = getattr(attn, "head_dim", None)
    if head_dim is None:  # llama, qwen: the o projection's input is n_heads x head_dim
        o = attn.o_proj
        k = o._gemm._w.k if hasattr(o, "_gemm") else o.weight.shape[1]
        head_dim = k // n_heads
    return n_heads, n_kv, int(head_dim), float(attn.scale)


def _projections(
    layer: nn.Module, dense: nn.Module | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The attention's input projections, and those of the dense MLPs (of `dense`, a layer with
    one; None: every MLP is a mixture of experts)."""
    attn = layer.self_attn
    mlp = None if dense is None else dense.mlp
    qkv = ("qkv_proj",) if hasattr(attn, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    gate_up = ("gate_up_proj",) if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj")
    for owner, names in ((attn, qkv), (mlp, gate_up)):
        if owner is not None and not all(hasattr(owner, n) for n in names):
            raise NotCovered(f"projections {type(owner).__name__}")
    if not (hasattr(attn, "o_proj") and (mlp is None or hasattr(mlp, "down_proj"))):
        raise NotCovered("o_proj or down_proj missing")
    return qkv, gate_up


def _experts(layers: list, code: Code) -> tuple[Routing | None, frozenset[int]]:
    """The routing of the layers whose MLP is a mixture of experts, and which they are."""
    found: dict[int, Routing] = {}
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        glu = getattr(mlp, "switch_mlp", None)
        if glu is None:
            continue
        if not code.experts:
            raise NotCovered(f"experts in {type(mlp).__name__}")
        if not (isinstance(glu, HostExperts) or HostExperts.takes(glu)):
            raise NotCovered(f"experts {type(glu).__name__} (biases or another activation)")
        if not hasattr(mlp, "gate"):
            raise NotCovered("experts without a router `gate`")
        found[i] = Routing(int(mlp.num_experts), int(mlp.top_k), bool(mlp.norm_topk_prob))
    routings = set(found.values())
    if len(routings) > 1:
        raise NotCovered("layers routed differently")
    return (routings.pop() if routings else None), frozenset(found)


def _qk_norm(attn: nn.Module, head_dim: int) -> QKNorm:
    q, k = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q is None and k is None:
        return QKNorm.NONE
    if q is None or k is None:
        raise NotCovered("a q norm without a k norm")
    width = q.weight.shape[0]
    if width == head_dim and k.weight.shape[0] == head_dim:
        return QKNorm.HEAD
    if width == int(attn.n_heads) * head_dim:
        return QKNorm.ALL
    raise NotCovered(f"q norm of width {width}")


def _is_rms_norm(m: object) -> bool:
    """nn.RMSNorm, or a family's own RMSNorm class (gemma's 1 + w: CODE says the offset)."""
    return type(m) is nn.RMSNorm or (
        type(m).__name__ == "RMSNorm" and hasattr(m, "weight") and hasattr(m, "eps")
    )


def _check_norms(inner: nn.Module, layers: list, code: Code) -> None:
    names = [n for n in (code.norms.pre_attn, code.norms.post_attn, code.norms.pre_mlp,
                         code.norms.post_mlp) if n is not None]  # fmt: skip
    for layer in layers:
        for n in names:
            if not _is_rms_norm(getattr(layer, n, None)):
                raise NotCovered(f"norm {n}")
        for n in ("q_norm", "k_norm"):
            m = getattr(layer.self_attn, n, None)
            if m is not None and not _is_rms_norm(m):
                raise NotCovered(f"norm {n}")
    if not _is_rms_norm(getattr(inner, "norm", None)):
        raise NotCovered("final norm")


def _windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window: the size of the rotating cache mlx-lm makes for it."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    out: list[int | None] = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            out.append(None)
        elif type(c) is RotatingKVCache and not c.keep:
            out.append(int(c.max_size))
        else:
            raise NotCovered(f"layer cache {type(c).__name__}")
    return out


def norm_weight(norm: nn.Module, offset: float) -> np.ndarray:
    """A norm's weight as the host step multiplies by it: float32 offset + w (mlx-lm's own
    `1.0 + self.weight` in float32 for gemma)."""
    w = norm.weight.astype(mx.float32)
    if offset:
        w = offset + w
    return np.asarray(w)
