"""Which engine runs a model: the paged engine, or mlx-lm's own batching (engine/unpaged.py).

Decided once per model at load time, from the caches mlx-lm makes for it and one short probe:

- every layer a plain KVCache → paged (mixture-of-experts models too: their experts live in the
  MLP, the attention is the standard one);
- sliding-window layers (RotatingKVCache of one size, nothing kept at its start) → paged, with
  those layers' masks limited to the window: the paged cache keeps every key, and a query seeing
  the last `window` of them is what mlx-lm's rotating cache gives;
- anything else (state-space or other array caches of hybrid models, chunked caches, caches
  whose rotation keeps a prefix) → unpaged;
- a paged model whose probe (two ragged prompts and a decode step through the paged runner,
  against mlx-lm's own forward) raises or differs → unpaged: an architecture the paged seam does
  not fit (e.g. multi-head latent attention) falls back rather than failing later. mlx-lm's
  llama code with plain caches (PAGED_MODULES: the default model's family, tested paged against
  mlx-lm in tests/engine) skips the probe, which cost about 0.4 s of every start; so does a
  model whose every step the host step runs (engine/host/step.py `covers`: each family it
  describes is tested paged against mlx-lm in tests/engine/test_host_families.py).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from batchmlx.core.engine_api import EngineSettings

_PROBE_PROMPTS = ((1, 5, 9, 2, 7, 3, 11, 4, 6, 8, 10, 12), (3, 1, 4, 1, 5))  # ragged on purpose
_PROBE_BLOCK = 4  # several blocks per probe prompt
# mlx-lm model code the paged runner is tested against (tests/engine: parity with mlx-lm's own
# forward, the real default model end to end): with plain caches, no probe needed at each start
PAGED_MODULES = frozenset({"mlx_lm.models.llama"})
log = logging.getLogger("batchmlx.engine")


class EnginePath(enum.Enum):
    PAGED = "paged"
    UNPAGED = "unpaged"


@dataclass(frozen=True, slots=True)
class ArchPlan:
    path: EnginePath
    reason: str  # one line for the log: why this path
    window: int | None = None  # sliding window of the windowed layers (paged path)
    # unpaged path: mlx-lm's batching fails or differs for it, so its single-request loop
    one_at_a_time: bool = False

    @property
    def paged(self) -> bool:
        return self.path is EnginePath.PAGED


def plan_architecture(model: Any, packed: bool = True) -> ArchPlan:
    """The engine path for `model` (an mlx-lm nn.Module), and why. packed: the engine runs
    packed (mixed) steps, the only ones the host step takes; without them every step is
    MLX's, which the probe checks."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    try:
        caches = make_prompt_cache(model)
    except Exception as exc:  # noqa: BLE001 - any failure here means: let mlx-lm drive it
        return _unpaged(model, f"mlx-lm cannot make its cache ({exc})")
    kinds = sorted({type(c).__name__ for c in caches})
    if any(type(c) not in (KVCache, RotatingKVCache) for c in caches):
        return _unpaged(
            model,
            f"layer caches {', '.join(kinds)}: not all key/value caches (hybrid or state-space)",
        )
    rotating = [c for c in caches if type(c) is RotatingKVCache]
    window = None
    if rotating:
        sizes = {c.max_size for c in rotating}
        if len(sizes) > 1 or any(c.keep for c in rotating):
            return _unpaged(
                model,
                f"rotating caches of sizes {sorted(sizes)} keeping "
                f"{sorted({c.keep for c in rotating})} tokens: not one plain sliding window",
            )
        window = sizes.pop()
    module = type(model).__module__
    # every step on the host: the host step is tested paged for each family it describes
    on_host = packed and _on_host(model)
    probed = (window is not None or module not in PAGED_MODULES) and not on_host
    if probed:
        failure = _probe(model, window)
        if failure is not None:
            return _unpaged(model, f"paged probe: {failure}")
    what = []
    if window is not None:
        what.append(f"sliding window {window} on {len(rotating)} of {len(caches)} layers")
    experts = _experts(model)
    if experts:
        what.append(f"mixture of {experts} experts")
    reason = ", ".join(what) or "standard attention"
    if not probed:
        where = " on the host step" if on_host else ""
        reason += f" ({module}{where}: tested paged, not probed)"
    return ArchPlan(EnginePath.PAGED, reason, window)


def _on_host(model: Any) -> bool:
    """Whether the host step will run every packed step of `model` (engine/host/step.py)."""
    from batchmlx.engine.host.step import covers

    return covers(model) is not None


def _unpaged(model: Any, reason: str) -> ArchPlan:
    """The unpaged plan, one request at a time when mlx-lm's own batching is wrong for it."""
    failure = _batch_probe(model)
    if failure is None:
        return ArchPlan(EnginePath.UNPAGED, reason)
    return ArchPlan(
        EnginePath.UNPAGED, f"{reason}; one request at a time (batched: {failure})",
        one_at_a_time=True,
    )  # fmt: skip


def _batch_probe(model: Any) -> str | None:
    """None when mlx-lm's BatchGenerator gives the ragged probe prompts the log-probs its
    single-request loop gives them, else what went wrong (e.g. a model whose own attention
    broadcasts a batch mask over the wrong axis)."""
    from mlx_lm.generate import BatchGenerator, generate_step

    steps = 2
    try:
        want = []
        for p in _PROBE_PROMPTS:
            want.append([lp for _, lp in generate_step(mx.array(p), model, max_tokens=steps)])
        gen = BatchGenerator(model, completion_batch_size=len(_PROBE_PROMPTS))
        uids = gen.insert([list(p) for p in _PROBE_PROMPTS], max_tokens=[steps] * 2)
        got: dict[int, list[mx.array]] = {u: [] for u in uids}
        while any(len(v) < steps for v in got.values()):
            for r in gen.next_generated():
                got[r.uid].append(r.logprobs)
        gen.close()
    except Exception as exc:  # noqa: BLE001 - the point of the probe
        return f"{type(exc).__name__}: {exc}"
    for u, ref in zip(uids, want, strict=True):
        for a, b in zip(got[u], ref, strict=True):
            diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            if not diff <= _tolerance(b.dtype) * max(1.0, mx.abs(b).max().item()):
                return f"log-probs differ from one request alone by {diff:.3g}"
    return None


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-3 if dtype == mx.float32 else 5e-2


def _host_tolerance(model: Any) -> float | None:
    """The probe's bound for a model in a bf16 or int8 host format (None: another): paged
    steps (on the host, or in MLX over the host layers) against mlx-lm's forward over the same
    layers differ in the order of float32 sums, whose last bits move some GEMM inputs across a
    bf16 rounding (or int8 quantization) step: tests/engine/test_host_step.py measures up to
    4.7e-3 (bf16) and 1.7e-2 (int8) of the largest logit; a 135M-shaped phi3's probe was
    1.4e-3 off, past the float32 bound, and went to the unpaged engine. A block the paged
    step got wrong is off by the logits' own size."""
    from batchmlx.engine.host.linear import HostEmbedding, HostFormat

    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not isinstance(emb, HostEmbedding):
        return None
    # (W8: an int8 or q4 model's embedding)
    bounds = {HostFormat.BF16: 5e-2, HostFormat.INT8: 1e-1, HostFormat.W8: 1e-1}
    return bounds.get(emb._gemm.fmt)


def _experts(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        n = getattr(args, name, None)
        if isinstance(n, int) and n > 1:
            return n
    return None


def _probe(model: Any, window: int | None) -> str | None:
    """None when the paged runner gives mlx-lm's logits on a ragged prefill and a decode step,
    else what went wrong."""
    from mlx_lm.models.cache import make_prompt_cache

    from batchmlx.engine.kv.paged import BatchLayout, PagedKVStorage
    from batchmlx.engine.runners.paged_forward import PagedForward, model_dims

    try:
        num_layers, n_kv, head_dim = model_dims(model)
        # mlx-lm's reference: each prompt alone, then one decode token
        refs, keys_dtype = [], None
        for p in _PROBE_PROMPTS:
            cache = make_prompt_cache(model)
            first = model(mx.array([p]), cache=cache)[0, -1]
            second = model(mx.array([[p[0]]]), cache=cache)[0, -1]
            keys_dtype = cache[0].state[0].dtype
            refs.append((first, second))
        blocks = [-(-(len(p) + 1) // _PROBE_BLOCK) for p in _PROBE_PROMPTS]
        storage = PagedKVStorage(
            num_layers=num_layers, n_kv_heads=n_kv, head_dim=head_dim, block_size=_PROBE_BLOCK,
            dtype=keys_dtype, max_blocks=1 + sum(blocks), grow_blocks=1 + sum(blocks),
        )  # fmt: skip
        tables, nxt = [], 1
        for n in blocks:
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        runner = PagedForward(model, storage, host_steps=False)  # (those are not probed)

        def run(chunks, starts):
            layout = BatchLayout.build(
                block_size=_PROBE_BLOCK, n_kv_heads=n_kv, token_chunks=chunks, starts=starts,
                block_tables=tables, share_prefix=window is None,
            )  # fmt: skip
            return runner.forward(layout, None)

        first = run([list(p) for p in _PROBE_PROMPTS], [0, 0])
        second = run([[p[0]] for p in _PROBE_PROMPTS], [len(p) for p in _PROBE_PROMPTS])
        mx.eval(first, second)
    except Exception as exc:  # noqa: BLE001 - the point of the probe
        return f"{type(exc).__name__}: {exc}"
    tol = _host_tolerance(model) or _tolerance(keys_dtype)
    for i, (a, b) in enumerate(refs):
        for got, want in ((first[i], a), (second[i], b)):
            want = want.astype(mx.float32)
            diff = mx.abs(got.astype(mx.float32) - want).max().item()
            scale = max(1.0, mx.abs(want).max().item())
            if not diff <= tol * scale:  # NaN fails too
                return f"logits differ from mlx-lm's by {diff:.3g} (scale {scale:.3g})"
    return None


def make_engine(
    model: Any, tokenizer: Any, *, name: str, context_length: int, config: EngineSettings
) -> Any:
    """The engine for `model`: paged where `plan_architecture` allows, else unpaged; the
    choice and its reason logged once."""
    from batchmlx.engine.runners.mlx_lm import mlx_lm_engine
    from batchmlx.engine.runners.paged import paged_engine

    plan = plan_architecture(model, packed=config.mixed_steps)
    model_type = getattr(getattr(model, "args", None), "model_type", type(model).__module__)
    log.info("model %s (%s): %s engine, %s", name, model_type, plan.path.value, plan.reason)
    if plan.paged:
        return paged_engine(
            model, tokenizer, context_length=context_length, config=config,
            sliding_window=plan.window,
        )  # fmt: skip
    return mlx_lm_engine(
        model, tokenizer, context_length=context_length, config=config,
        batched=not plan.one_at_a_time,
    )  # fmt: skip
