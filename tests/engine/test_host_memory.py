"""Freed memory is given back (engine/host/memory.py): the heap's free pages by the engine's
steps, MLX's buffer cache after a large one-off request. Tiny random model, in-process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.core import EngineCore
from batchmlx.engine.host.memory import HeapTrimmer
from batchmlx.engine.kv.budget import CPU_BUFFER_CACHE
from batchmlx.engine.runners.paged import paged_engine

MB = 1 << 20
glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _fragment() -> list[mx.array]:
    """200 freed 2 MiB buffers the heap keeps: glibc's mmap threshold rises past 2 MiB at the
    first free of a larger mmapped buffer, and small live buffers between them stop the heap
    shrinking from its top (what serve's mixed steps did: 150-700 MB kept)."""
    w = mx.ones((MB,))  # 4 MiB, mmapped; freed, it raises the threshold
    mx.eval(w)
    del w
    big, small = [], []
    for _ in range(200):
        a, s = mx.ones((MB // 2,)), mx.ones((16,))
        mx.eval(a, s)
        big.append(a)
        small.append(s)
    big.clear()
    return small


def _engine(model) -> EngineCore:
    cfg = EngineSettings(block_size=4, cache_memory_mb=64, max_prefill_tokens=64)
    return paged_engine(model, None, context_length=256, config=cfg, seed=0)


@glibc
def test_engine_steps_give_the_heaps_freed_pages_back():
    # in a fresh interpreter: the heap's state (its mmap threshold, what earlier tests left in
    # it) decides whether freed buffers stay in it, so only a fresh process shows it
    root = Path(__file__).resolve().parents[2]
    code = "from tests.engine.test_host_memory import heap_case; heap_case()"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trimmed" in out.stdout


def heap_case() -> None:
    from mlx_lm.models.llama import Model, ModelArgs

    mx.random.seed(0)
    model = Model(ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                            tie_word_embeddings=True, head_dim=16))  # fmt: skip
    mx.eval(model.parameters())
    e = _engine(model)
    e.heap = HeapTrimmer(every_s=0.0)  # every step trims (the default: every 5 s of steps)
    mx.set_cache_limit(0)  # MLX's own cache out of the picture: the heap alone
    before = _rss()
    keep = _fragment()
    assert _rss() - before > 300 * MB, "the heap kept them"
    e.generate([GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), [])])
    assert _rss() - before < 100 * MB, "the step's trim gave the heap's free pages back"
    assert e.heap.trims >= 1
    del keep
    print("trimmed")


def test_heap_trimmer_trims_at_most_every_interval():
    now = [0.0]
    t = HeapTrimmer(every_s=5.0, clock=lambda: now[0])
    for now[0] in (1.0, 4.9, 5.0, 6.0, 9.9, 10.1):
        t.tick()
    assert t.trims == 2  # at 5.0 and 10.1


def test_release_after_a_large_embeddings_request_empties_mlx_cache(tiny_model):
    e = _engine(tiny_model)
    inputs = [[(i * 7 + j) % 250 + 1 for j in range(40)] for i in range(200)]  # 8,000 tokens
    e.embedder.embed(inputs)
    assert mx.get_cache_memory() > 0  # the passes' freed buffers, kept for reuse
    assert mx.get_cache_memory() <= CPU_BUFFER_CACHE  # its bound (size_buffer_cache)
    assert e.release_memory() > 0
    assert mx.get_cache_memory() == 0
