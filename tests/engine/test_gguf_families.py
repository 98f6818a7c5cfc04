"""GGUF files of every family batchmlx loads (core/gguf_support.ARCHITECTURES), written as
llama.cpp writes them (tests/gguf_files.py) from a tiny random mlx-lm model, loaded through the
real loader: greedy tokens equal mlx-lm's on the same float weights. Quantized files: every
weight equals gguf-py's dequantization of the file."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.core.gguf_support import ARCHITECTURES
from batchmlx.core.models import resolve_model
from batchmlx.engine.models.loader import load_model
from tests.gguf_files import CASES, VOCAB, hf_weights, random_model, write_gguf

PROMPT = [5, 200, 17, 99, 3, 256, 41, 7, 130, 12, 64, 250]
STEPS = 6


def greedy(model, prompt: list[int], steps: int = STEPS) -> tuple[list[int], np.ndarray]:
    """Greedy tokens by whole-sequence forwards (no cache), and the first step's logits."""
    ids = list(prompt)
    first = None
    for _ in range(steps):
        logits = model(mx.array([ids]))[0, -1].astype(mx.float32)
        first = np.array(logits) if first is None else first
        ids.append(int(mx.argmax(logits).item()))
    return ids[len(prompt) :], first


def load(path: Path, cache: Path):
    spec = resolve_model(str(path), cache_dir=cache)
    assert spec is not None and spec.kind == "gguf"
    # the converted folder's float32 weights as MLX arrays ("float32" is a host format on an
    # AVX-512 CPU: its layers packed, no `.weight` to compare)
    return load_model(spec, cache_dir=cache, dtype="stored")


def test_every_family_has_a_case() -> None:
    assert set(CASES) == set(ARCHITECTURES)


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_greedy_equals_mlx_lm(family: str, tmp_path: Path) -> None:
    case = CASES[family]
    reference = random_model(case.config)
    path = write_gguf(tmp_path / f"{family}.gguf", case, hf_weights(reference))
    loaded = load(path, tmp_path / "cache")
    assert type(loaded.model).__module__ == type(reference).__module__
    want, want_logits = greedy(reference, PROMPT)
    got, got_logits = greedy(loaded.model, PROMPT)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    assert got == want
    assert loaded.config["vocab_size"] == VOCAB


def test_chat_template_and_tokenizer_come_from_the_file(tmp_path: Path) -> None:
    case = CASES["qwen2"]
    path = write_gguf(tmp_path / "q.gguf", case, hf_weights(random_model(case.config)))
    tok = load(path, tmp_path / "cache").tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "the"}],
                                   add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(" the the")
    assert ids == [258, 258]  # "Ġthe" twice, through the file's merges
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_end|>") == [VOCAB - 1]
    assert VOCAB - 1 in tok.eos_token_ids


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path) -> None:
    """Llama 3.1's scaling, which llama.cpp writes as the rope_freqs tensor, loads as mlx-lm's
    llama3 RoPE: the same tokens as mlx-lm with that config."""
    from batchmlx.engine.models.gguf.rope import llama3_factors

    case = CASES["llama"]
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    config = {**case.config, "rope_scaling": scaling, "rope_theta": 500000.0}
    reference = random_model(config)
    freqs = llama3_factors(scaling, 500000.0, config["head_dim"]).astype(np.float32)
    weights = {**hf_weights(reference), "rope_freqs.weight": freqs}
    path = write_gguf(tmp_path / "l3.gguf", replace(case, config=config), weights)
    loaded = load(path, tmp_path / "cache")
    assert loaded.config["rope_scaling"] == scaling
    long_prompt = PROMPT * 8  # past original_max_position_embeddings
    assert greedy(loaded.model, long_prompt, 3)[0] == greedy(reference, long_prompt, 3)[0]


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_from_keys(kind: str, tmp_path: Path) -> None:
    import gguf

    case = CASES["qwen2"]
    scaling = {"type": kind, "factor": 4.0}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = 64
    config = {**case.config, "rope_scaling": scaling}
    reference = random_model(config)

    def keys(w) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType(kind))
        w.add_rope_scaling_factor(4.0)
        if kind == "yarn":
            w.add_rope_scaling_orig_ctx_len(64)

    path = write_gguf(tmp_path / "s.gguf", replace(case, config=config), hf_weights(reference),
                      extra_keys=keys)  # fmt: skip
    loaded = load(path, tmp_path / "cache")
    assert loaded.config["rope_scaling"] == scaling
    long_prompt = PROMPT * 8  # past the original context
    assert greedy(loaded.model, long_prompt, 3)[0] == greedy(reference, long_prompt, 3)[0]


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_runs_in_the_engine_as_loaded_by_default(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file loaded as a user gets it (--dtype auto: host weight formats on the CPU) runs
    through batchmlx's engine: several requests at once give mlx-lm's own greedy tokens on
    that loaded model (over a float32 KV pool, as mlx-lm keeps its keys: the float16 pool of
    int8 and bf16 host steps moved a random llama's logprobs by up to 0.08 and parted a
    0.10 near-tie; its fidelity on real text: benchmarks/RESULTS-paged-attention.md)."""
    from batchmlx.engine.runners import paged as paged_runner

    monkeypatch.setattr(paged_runner, "host_pool_dtype", lambda model: None)
    from mlx_lm.generate import generate_step

    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.choose import make_engine

    case = CASES[family]
    path = write_gguf(tmp_path / f"{family}.gguf", case, hf_weights(random_model(case.config)))
    spec = resolve_model(str(path), cache_dir=tmp_path / "cache")
    loaded = load_model(spec, cache_dir=tmp_path / "cache")
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 13, 200]]
    want = [[int(t) for t, _ in generate_step(mx.array(p), loaded.model, max_tokens=STEPS)]
            for p in prompts]  # fmt: skip
    settings = EngineSettings(block_size=4, cache_memory_mb=16, max_prefill_tokens=64,
                              max_batch_size=4)  # fmt: skip
    eng = make_engine(loaded.model, None, name=family, context_length=256, config=settings)
    params = SamplingParams(max_tokens=STEPS, temperature=0.0)
    outs = eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    assert [o.token_ids for o in outs] == want


def test_phi3_longrope_from_its_factor_tensors(tmp_path: Path) -> None:
    """Phi-3's 128k scaling: llama.cpp writes its factors as the rope_factors_long/short
    tensors and the original context as a key; they load as mlx-lm's longrope (SuScaledRoPE)."""
    case = CASES["phi3"]
    rot = int(case.config["head_dim"] * case.config["partial_rotary_factor"])
    rng = np.random.default_rng(2)
    long = (1 + 4 * rng.random(rot // 2)).astype(np.float32)
    short = (1 + rng.random(rot // 2)).astype(np.float32)
    config = {**case.config, "original_max_position_embeddings": 64,
              "rope_scaling": {"type": "longrope", "long_factor": long.tolist(),
                               "short_factor": short.tolist()}}  # fmt: skip
    reference = random_model(config)
    weights = {**hf_weights(reference), "rope_factors_long.weight": long,
               "rope_factors_short.weight": short}  # fmt: skip
    path = write_gguf(tmp_path / "phi.gguf", replace(case, config=config), weights,
                      extra_keys=lambda w: w.add_rope_scaling_orig_ctx_len(64))  # fmt: skip
    loaded = load(path, tmp_path / "cache")
    assert loaded.config["rope_scaling"]["type"] == "longrope"
    assert loaded.config["original_max_position_embeddings"] == 64
    long_prompt = PROMPT * 8
    assert greedy(loaded.model, long_prompt, 3)[0] == greedy(reference, long_prompt, 3)[0]
