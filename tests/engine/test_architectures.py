"""Every architecture family mlx-lm runs, through batchmlx: paged where it fits, mlx-lm's own
batching where not (engine/choose.py), greedy tokens equal to mlx-lm's `generate_step` on the same
random weights, for several concurrent requests of different lengths."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import (
    deepseek_v3,
    falcon_h1,
    gemma2,
    gemma3_text,
    lfm2,
    llama,
    llama4,
    mamba2,
    mixtral,
    qwen3_moe,
)

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import FinishReason, GenerationRequest, SamplingParams
from batchmlx.engine.choose import EnginePath, make_engine, plan_architecture
from batchmlx.engine.runners.mlx_lm import MlxLmRunner, mlx_lm_engine
from batchmlx.engine.runners.paged import PagedRunner, paged_engine

VOCAB = 256
NEW_TOKENS = 10
BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=512,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    module: Any
    args: dict
    path: EnginePath
    window: int | None = None
    one_at_a_time: bool = False
    base: bool = True  # args start from BASE (the shared tiny dimensions)


FAMILIES = [
    Family(
        "llama",
        llama,
        dict(
            model_type="llama",
            intermediate_size=128,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
            head_dim=16,
        ),
        EnginePath.PAGED,
    ),
    # mistral-style: the first layer sees a 6-token window (mlx-lm gives it a RotatingKVCache)
    Family(
        "sliding window (llama layer_types)",
        llama,
        dict(
            model_type="llama",
            intermediate_size=128,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
            head_dim=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
        ),
        EnginePath.PAGED,
        6,
    ),
    # gemma3: rotating caches on the local layers, a different RoPE base there
    Family(
        "rotating cache (gemma3_text)",
        gemma3_text,
        dict(
            model_type="gemma3_text",
            intermediate_size=128,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=5,
            sliding_window_pattern=2,
            vocab_size=VOCAB,
        ),
        EnginePath.PAGED,
        5,
    ),
    Family(
        "hybrid conv + attention (lfm2)",
        lfm2,
        dict(
            model_type="lfm2",
            norm_eps=1e-5,
            conv_bias=False,
            conv_L_cache=3,
            block_dim=64,
            block_multiple_of=16,
            block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False,
            block_ff_dim=128,
            full_attn_idxs=[1],
        ),
        EnginePath.UNPAGED,
    ),
    Family(
        "state space (mamba2)",
        mamba2,
        dict(
            model_type="mamba2",
            num_heads=4,
            head_dim=16,
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=64,
            state_size=16,
            num_hidden_layers=2,
            layer_norm_epsilon=1e-5,
            conv_kernel=4,
            n_groups=1,
            use_bias=False,
            use_conv_bias=True,
            tie_word_embeddings=True,
            time_step_limit=(0.0, float("inf")),
            time_step_rank=4,
        ),
        EnginePath.UNPAGED,
        base=False,
    ),
    # attention and state-space side by side in each layer (one CacheList per layer)
    Family(
        "hybrid attention + mamba (falcon_h1)",
        falcon_h1,
        dict(
            model_type="falcon_h1",
            intermediate_size=128,
            head_dim=16,
            mamba_d_conv=4,
            mamba_d_head=16,
            mamba_d_ssm=64,
            mamba_d_state=16,
            mamba_n_heads=4,
            mamba_chunk_size=16,
            rope_theta=1e4,
        ),
        EnginePath.UNPAGED,
    ),
    Family(
        "mixture of experts (qwen3_moe)",
        qwen3_moe,
        dict(
            model_type="qwen3_moe",
            intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=32,
            rms_norm_eps=1e-5,
            head_dim=16,
            rope_theta=1e4,
            norm_topk_prob=True,
        ),
        EnginePath.PAGED,
    ),
    Family(
        "mixture of experts (mixtral)",
        mixtral,
        dict(
            model_type="mixtral",
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
        ),
        EnginePath.PAGED,
    ),
    # multi-head latent attention: keys and values the paged seam does not fit
    Family(
        "latent attention + experts (deepseek_v3)",
        deepseek_v3,
        dict(
            model_type="deepseek_v3",
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            rms_norm_eps=1e-5,
        ),
        EnginePath.UNPAGED,
    ),
    # attention written in the model: its mask broadcast fits one sequence at a time only
    Family(
        "softcapped attention (gemma2)",
        gemma2,
        dict(
            model_type="gemma2",
            intermediate_size=128,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
        ),
        EnginePath.UNPAGED,
        one_at_a_time=True,
    ),
    # chunked attention: mlx-lm cannot batch its ChunkedKVCache, so its single-request loop
    Family(
        "chunked attention + experts (llama4)",
        llama4,
        dict(
            model_type="llama4",
            text_config=dict(
                model_type="llama4_text",
                attention_bias=False,
                attention_chunk_size=8,
                head_dim=16,
                hidden_size=64,
                interleave_moe_layer_step=1,
                intermediate_size=32,
                intermediate_size_mlp=128,
                max_position_embeddings=512,
                num_attention_heads=4,
                num_experts_per_tok=1,
                num_hidden_layers=4,
                num_key_value_heads=2,
                num_local_experts=4,
                rms_norm_eps=1e-5,
                rope_scaling=None,
                rope_theta=1e4,
                use_qk_norm=True,
                vocab_size=VOCAB,
            ),
        ),
        EnginePath.UNPAGED,
        one_at_a_time=True,
        base=False,
    ),
]


def build(family: Family):
    mx.random.seed(0)
    args = {**(BASE if family.base else {}), **family.args}
    model = family.module.Model(family.module.ModelArgs.from_dict(args))
    model.set_dtype(mx.float32)
    # larger weights so the argmax is decided by the context, not near-ties
    model.update(tree_map(lambda p: p * 2.0, model.parameters()))
    mx.eval(model.parameters())
    return model


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(1, VOCAB, size=9).tolist()
    return [rng.integers(1, VOCAB, size=n).tolist() for n in (3, 14, 7)] + [
        shared + rng.integers(1, VOCAB, size=4).tolist(),
        shared + [5],
    ]


def reference(model, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own generation loop, one request alone (greedy)."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def family(request):
    return request.param, build(request.param)


def engine(model, **cfg):
    base = dict(block_size=4, cache_memory_mb=16, max_prefill_tokens=64, max_batch_size=4)
    base.update(cfg)
    return make_engine(model, None, name="tiny", context_length=256,
                       config=EngineSettings(**base))  # fmt: skip


def test_plan_names_the_path_and_why(family, caplog):
    fam, model = family
    plan = plan_architecture(model)
    assert plan.path is fam.path, plan.reason
    assert plan.window == fam.window
    assert plan.one_at_a_time == fam.one_at_a_time
    with caplog.at_level(logging.INFO, logger="batchmlx.engine"):
        eng = engine(model)
    assert isinstance(eng.runner, PagedRunner if fam.path is EnginePath.PAGED else MlxLmRunner)
    if isinstance(eng.runner, MlxLmRunner):
        assert eng.runner.batched is not fam.one_at_a_time
    (line,) = [r.getMessage() for r in caplog.records if "engine," in r.getMessage()]
    assert f"{fam.path.value} engine" in line and plan.reason in line


def test_greedy_tokens_equal_mlx_lm(family):
    """Five requests of different lengths, at most four running at once (so one joins late)."""
    fam, model = family
    ps = prompts()
    want = [reference(model, p, NEW_TOKENS) for p in ps]
    eng = engine(model)
    assert isinstance(eng.runner, PagedRunner if fam.path is EnginePath.PAGED else MlxLmRunner)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ps)])
    got = [o.token_ids for o in outs]
    assert got == want
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
def test_the_kv_dtype_probe_through_one_layer_agrees_with_a_whole_forward(family, dtype):
    # the paged pool stores keys in the dtype the model writes them in; the probe runs the
    # first layer alone (0.01 s against 0.12-0.17 s at 135M) and must give the same answer
    from mlx_lm.models.cache import make_prompt_cache

    from batchmlx.engine.runners.paged import _kv_dtype

    fam, model = family
    if fam.path is not EnginePath.PAGED:
        pytest.skip("the paged pool is not made for it")
    weights = model.parameters()  # the module's model: its exact float32 weights restored
    model.set_dtype(dtype)
    try:
        layers = list(model.layers)
        cache = make_prompt_cache(model)
        model(mx.array([[0]]), cache=cache)
        assert _kv_dtype(model) == cache[0].state[0].dtype
        after = list(model.layers)  # every layer back in place
        assert len(after) == len(layers) and all(a is b for a, b in zip(after, layers, strict=True))
    finally:
        model.update(weights)


def test_llama_with_plain_caches_skips_the_probe(monkeypatch):
    """mlx-lm's llama code is tested paged (above, and the real default model): no probe at
    each start. Its sliding-window variant and every other family are still probed."""
    from batchmlx.engine import choose as arch

    llama_fam, window_fam = FAMILIES[0], FAMILIES[1]
    moe_fam = next(f for f in FAMILIES if f.name.startswith("mixture of experts (qwen3"))
    probed = []

    def broken(model, window):
        probed.append(type(model).__module__)
        return "broken on purpose"

    monkeypatch.setattr(arch, "_probe", broken)
    plan = plan_architecture(build(llama_fam))
    assert plan.path is EnginePath.PAGED and "not probed" in plan.reason
    assert probed == []
    for fam in (window_fam, moe_fam):
        plan = plan_architecture(build(fam))
        assert plan.path is EnginePath.UNPAGED
        assert "paged probe: broken on purpose" in plan.reason
    assert probed == ["mlx_lm.models.llama", "mlx_lm.models.qwen3_moe"]


def test_the_probe_passes_the_llama_it_skips():
    from batchmlx.engine.choose import _probe

    assert _probe(build(FAMILIES[0]), None) is None


# -- the unpaged engine's request semantics, against the paged engine on the same llama ----------


class CharTokenizer:
    """Token id i decodes to chr(i): enough for stop strings."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.fixture(scope="module")
def llama_model():
    return build(FAMILIES[0])


def both(model, batched=True, **cfg):
    base = dict(block_size=4, cache_memory_mb=16, max_prefill_tokens=64, max_batch_size=4)
    base.update(cfg)
    settings = EngineSettings(**base)
    tok = CharTokenizer()
    return (
        paged_engine(model, tok, context_length=256, config=settings, seed=7),
        mlx_lm_engine(model, tok, context_length=256, config=settings, seed=7, batched=batched),
    )


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_unpaged_seeds_and_logprobs_match_the_paged_engine(llama_model, batched):
    """Sampled rows draw through the same sampler keyed by (seed, index); log-probs of the raw
    logits with their top alternatives."""
    ps = prompts()
    params = [
        SamplingParams(max_tokens=8, temperature=0.9, seed=11, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.3, top_p=0.8, seed=5),
        SamplingParams(max_tokens=5, temperature=0.7, seed=11),
        SamplingParams(max_tokens=8, temperature=0.0),
    ]
    pairs = enumerate(zip(ps, params, strict=True))
    reqs = [GenerationRequest(f"r{i}", p, sp) for i, (p, sp) in pairs]
    paged, unpaged = (e.generate(reqs) for e in both(llama_model, batched))
    assert [o.token_ids for o in unpaged] == [o.token_ids for o in paged]
    for a, b in zip(unpaged, paged, strict=True):
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
            assert x.token_id == y.token_id
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_unpaged_finish_rules(llama_model, batched):
    """End-of-sequence (not output), stop strings (generation ends at them), max_tokens."""
    p = prompts()[1]
    free = reference(llama_model, p, NEW_TOKENS)
    eos, stop_at = free[4], free[2]
    _, eng = both(llama_model, batched)
    outs = eng.generate([
        GenerationRequest("eos", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
                          stop_token_ids=frozenset({eos})),
        GenerationRequest("stop", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                    stop=(chr(stop_at),))),
        GenerationRequest("len", p, SamplingParams(max_tokens=3, temperature=0.0)),
    ])  # fmt: skip
    first_eos = free.index(eos)
    assert outs[0].token_ids == free[:first_eos]
    assert outs[0].finish_reason is FinishReason.STOP
    assert outs[1].token_ids == free[: free.index(stop_at) + 1]
    assert outs[1].finish_reason is FinishReason.STOP
    assert outs[2].token_ids == free[:3] and outs[2].finish_reason is FinishReason.LENGTH
    assert not eng.has_unfinished()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_unpaged_abort_and_streams(llama_model, batched):
    _, eng = both(llama_model, batched)
    streamed: list[tuple[str, int]] = []
    eng.on_token = lambda rid, tok: streamed.append((rid, tok))
    ps = prompts()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    eng.add(GenerationRequest("a", ps[0], params))
    eng.add(GenerationRequest("b", ps[1], params))
    eng.step()
    assert eng.abort("a") and not eng.abort("a")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["b"]
    assert outs[0].token_ids == reference(llama_model, ps[1], 6)
    assert [t for r, t in streamed if r == "b"] == outs[0].token_ids
    assert eng.counters().generated_tokens >= 6


# -- the worker's wiring: a model folder loaded by name gets the engine its architecture needs ----


@pytest.mark.parametrize("fam", [FAMILIES[2], FAMILIES[3]], ids=["gemma3_text", "lfm2"])
def test_worker_build_picks_the_engine(fam, tmp_path, caplog, monkeypatch):
    """build_engine (what the worker runs for a model name) on a folder of each kind: the engine
    the plan names, no embeddings where the embedder does not fit, schemas accepted, and a
    request's greedy tokens equal mlx-lm's (over a float32 KV pool, as mlx-lm keeps its keys:
    the float16 pool of int8 and bf16 host steps moved this random model's logprobs by up to
    0.08, its fidelity measured apart: benchmarks/RESULTS-paged-attention.md)."""
    from batchmlx.engine.runners import paged as paged_runner

    monkeypatch.setattr(paged_runner, "host_pool_dtype", lambda model: None)
    from batchmlx.worker.build import build_engine
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_model import build_tiny_model

    config = {**BASE, **fam.args, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
    folder = build_tiny_model(tmp_path / fam.args["model_type"], model_cache_dir(), config)
    with caplog.at_level(logging.INFO, logger="batchmlx.engine"):
        serving = build_engine(str(folder), cache_dir=tmp_path, settings=EngineSettings(
            block_size=4, cache_memory_mb=64, max_batch_size=4))  # fmt: skip
    assert any(f"{fam.path.value} engine" in r.getMessage() for r in caplog.records)
    eng = serving.engine
    assert isinstance(eng.runner, PagedRunner if fam.path is EnginePath.PAGED else MlxLmRunner)
    assert serving.embedder is None  # rotating and hybrid caches: no embeddings here
    assert serving.translator.grammar_check('{"type": "object"}') is None
    model = (
        eng.runner.forward_pass.model if isinstance(eng.runner, PagedRunner) else eng.runner.model
    )
    ps = prompts()
    want = [reference(model, p, 6) for p in ps]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs = eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ps)])
    assert [o.token_ids for o in outs] == want


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_unpaged_structured_outputs_match_the_paged_engine(tiny_model_dir, batched):
    """The same constrained requests (greedy and seeded) through both engines on one model with
    the real tokenizer: the same tokens, and every answer that completed is valid JSON."""
    import json

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model
    from batchmlx.formats.structured import canonical_schema

    # float32: the paged engine's host step and the unpaged engine's MLX forward compute the
    # same model with different kernels (at int8 the host step's KV pool is float16, MLX's
    # cache float32), so only at float32 are their logits close enough that a random model's
    # near ties (token 13 here, after 13 repeats of one token) fall the same way in both
    loaded = load_model(resolve_model(str(tiny_model_dir), cache_dir=tiny_model_dir),
                        cache_dir=tiny_model_dir, dtype="float32")  # fmt: skip
    schema = canonical_schema({
        "type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
        "required": ["ok", "n"], "additionalProperties": False,
    })  # fmt: skip
    ps = [loaded.tokenizer.encode(t) for t in ("Answer:", "JSON please", "x")]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=9),
    ]
    eos = frozenset(loaded.eos_token_ids)
    reqs = [GenerationRequest(f"g{i}", p, sp, stop_token_ids=eos, grammar=schema)
            for i, (p, sp) in enumerate(zip(ps, params, strict=True))]  # fmt: skip
    reqs.append(GenerationRequest("free", ps[0], params[0], stop_token_ids=eos))
    settings = EngineSettings(block_size=4, cache_memory_mb=64, max_batch_size=4)
    paged = paged_engine(loaded.model, loaded.tokenizer, context_length=256, config=settings)
    unpaged = mlx_lm_engine(loaded.model, loaded.tokenizer, context_length=256, config=settings,
                            batched=batched)  # fmt: skip
    want, got = paged.generate(reqs), unpaged.generate(reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    completed = [o for o in got[:3] if o.finish_reason is FinishReason.STOP]
    assert completed  # the grammar ends at least one answer
    for o in completed:
        assert set(json.loads(loaded.tokenizer.decode(o.token_ids))) == {"ok", "n"}


@pytest.mark.parametrize("fam", [FAMILIES[1], FAMILIES[2]], ids=["llama-sliding", "gemma3_text"])
def test_sliding_window_long_prompts_chunked_and_cached(fam):
    """Prompts several windows long, prefilled in chunks shorter than the window, the second
    and third reusing the first's cached prefix blocks: still mlx-lm's tokens."""
    model = build(fam)
    rng = np.random.default_rng(5)
    long = rng.integers(1, VOCAB, size=37).tolist()
    ps = [long, long + rng.integers(1, VOCAB, size=5).tolist(), long[:29] + [7, 8]]
    want = [reference(model, p, NEW_TOKENS) for p in ps]
    eng = engine(model, max_prefill_tokens=8, max_batch_size=1)  # one at a time: cache hits
    assert isinstance(eng.runner, PagedRunner) and eng.runner.sliding_window == fam.window
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    outs = eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(ps)])
    assert [o.token_ids for o in outs] == want
    assert outs[1].cached_tokens > 0 and outs[2].cached_tokens > 0


def test_kv_memory_is_the_gpus_on_cuda(monkeypatch):
    """On MLX's CUDA backend the KV cache's share is of the GPU's free memory, not the host's."""
    import os

    from batchmlx.engine.kv import budget as llm_engine
    from batchmlx.engine.kv.budget import available_memory_bytes

    pages = {"SC_AVPHYS_PAGES": 1 << 20, "SC_PAGE_SIZE": 4096}  # a host with 4 GiB available
    monkeypatch.setattr(os, "sysconf", pages.__getitem__)
    monkeypatch.setattr(llm_engine, "_mem_available", lambda: None)  # no /proc/meminfo
    cuda_info = {"device_name": "NVIDIA H200", "free_memory": 140 << 30, "total_memory": 141 << 30}
    assert available_memory_bytes(on_gpu=True, device_info=cuda_info) == 140 << 30
    assert available_memory_bytes(on_gpu=False) == 4 << 30
    assert available_memory_bytes(on_gpu=True, device_info={"memory_size": 1 << 40}) == 4 << 30


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-at-a-time"])
def test_unpaged_admits_online_requests_first(llama_model, batched):
    """A full batch admits a waiting online request (priority 0) before earlier batch work."""
    _, eng = both(llama_model, batched, max_batch_size=1)
    ps = prompts()
    params = SamplingParams(max_tokens=4, temperature=0.0)
    eng.add(GenerationRequest("b1", ps[0], params, priority=1))
    eng.add(GenerationRequest("b2", ps[1], params, priority=1))
    order = [o.request_id for o in eng.step()]
    eng.add(GenerationRequest("online", ps[2], params, priority=0))
    assert eng.counters().running == 1
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step()]
    assert order == ["b1", "online", "b2"]
