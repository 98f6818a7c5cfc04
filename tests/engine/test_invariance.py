"""Batch invariance (issue 47): a request's greedy tokens and log-probs are the same bits alone
and inside a batch. Kernel by kernel (every GEMM path: row i of A @ W at M = 1..70 is the row
computed alone, at one and two threads; decode attention beside longer sequences), then through
the real engine on a random-weight model of the default model's shapes at each host format
(alone in simple mode, joining running batches of several widths, behind a prefix-cache hit,
cut by the step's budget elsewhere, preempted and resumed), and on the real default model at
the default dtype. docs/engine.md, "Batch invariance", says what is guaranteed and what is not
(a shared prefix's cascade)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import qwen3_moe

from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.host import attention as host_attention
from batchmlx.engine.host import paged_attention
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.linear import HostFormat, SharedGemm, to_host_format
from batchmlx.engine.kv.paged import KEY_GROUP
from tests.engine.helpers import host_formats, random_llama, where_it_runs
from tests.engine.test_engine_tiny import engine, staggered

pytestmark = pytest.mark.skipif(not current().onednn_available(), reason="oneDNN (onednn-cpu-gomp)")

# the default model's GEMM shapes (N, K): q+k+v, o, gate+up, down, the tied head; and a
# mixture of experts' at its widths (_moe_model): an expert's gate+up and down
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "head": (49152, 576), "expert_gate_up": (1536, 576),
          "expert_down": (576, 768)}  # fmt: skip
ROWS = 70


def _oneDNN_float32() -> bool:
    return current().onednn().brgemm(HostFormat.F32.data_type)


def _invariant_formats() -> list:
    """The host formats, float32 skipped where it runs on numpy's BLAS (no oneDNN brgemm: an
    AVX2-only CPU), whose one-row product is a GEMV summed in another order."""
    out = []
    for p in host_formats():
        (fmt,) = p.values
        marks = list(p.marks)
        if fmt is HostFormat.F32 and not _oneDNN_float32():
            marks.append(pytest.mark.skip(reason="float32 on numpy's BLAS: not invariant"))
        out.append(pytest.param(fmt, id=p.id, marks=marks))
    return out


FORMATS = _invariant_formats()
# and int8's and q4's head (engine/host/head8.py), a GEMM alone: its one path here, every width
W8 = pytest.param(HostFormat.W8, id=HostFormat.W8.value, marks=where_it_runs(HostFormat.W8))


@pytest.mark.parametrize("fmt", [*FORMATS, W8])
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_gemm_row_is_the_row_computed_alone(fmt, name):
    n, k = SHAPES[name]
    rng = np.random.default_rng(0)
    gemm = SharedGemm([mx.array(rng.standard_normal((n, k)).astype(np.float32) * 0.05)], fmt)
    a = rng.standard_normal((ROWS, k)).astype(np.float32)
    threads = gemm.backend.threads
    before = threads.n
    try:
        for count in (2, 1):
            threads.n = count
            alone = np.concatenate([gemm.host(a[i : i + 1]) for i in range(ROWS)])
            differ = [m for m in range(1, ROWS + 1) if not (gemm.host(a[:m]) == alone[:m]).all()]
            assert differ == [], (count, differ)
    finally:
        threads.n = before


def test_decode_attention_rows_are_the_rows_computed_alone():
    """One query per sequence over its keys, beside sequences up to 30x longer: the keys
    padded (masked) to the batch's longest, as the engine pads them (to KEY_GROUP)."""
    rng = np.random.default_rng(0)
    h, rep, d = 3, 3, 64
    lengths = [int(x) for x in rng.integers(1, 900, 40)] + [33, 64, 1000]
    room = -(-max(lengths) // KEY_GROUP) * KEY_GROUP
    q = rng.standard_normal((len(lengths), h, rep, d)).astype(np.float32) * 0.3
    k = rng.standard_normal((len(lengths), h, room, d)).astype(np.float32)
    v = rng.standard_normal((len(lengths), h, room, d)).astype(np.float32)
    seen = np.arange(room)[None, :] < np.array(lengths)[:, None]
    bias = np.where(seen, np.float32(0), np.float32(-np.inf))[:, None, None, :]
    batch = host_attention.decode_attention(q, k, v, bias)
    for i, n in enumerate(lengths):
        own = -(-n // KEY_GROUP) * KEY_GROUP
        one = [np.ascontiguousarray(a[i : i + 1, ..., :own, :]) for a in (k, v)]
        alone = host_attention.decode_attention(
            q[i : i + 1], *one, np.ascontiguousarray(bias[i : i + 1, ..., :own])
        )
        assert (alone[0] == batch[i]).all(), (i, n)


def _model(fmt: HostFormat):
    """A 2-layer random llama of the default model's widths (576 hidden, 9 query and 3 KV heads
    of 64, 1,536 MLP, 49,152 vocabulary): its GEMMs take the kernels the real model's take."""
    m = random_llama(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)  # fmt: skip
    return to_host_format(m, fmt)


def _moe_model(fmt: HostFormat):
    """A 2-layer random qwen3_moe of the default model's widths: 8 experts of 768, 2 a token."""
    mx.random.seed(0)
    args = qwen3_moe.ModelArgs(
        model_type="qwen3_moe", hidden_size=576, num_hidden_layers=2, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=2048, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=768,
        norm_topk_prob=True,
    )  # fmt: skip
    m = qwen3_moe.Model(args)
    m.set_dtype(mx.float32)
    m.update(tree_map(lambda p: p * 4.0, m.parameters()))
    mx.eval(m.parameters())
    return to_host_format(m, fmt)


PARAMS = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=2)
CFG = dict(block_size=8, cache_memory_mb=256, max_prefill_tokens=8192, max_batch_size=128)


def _prompts(n: int, seed: int, longest: int = 70) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 49152, size=int(rng.integers(5, longest))).tolist() for _ in range(n)]


def _bits(out) -> tuple[list[int], list[float]]:
    return out.token_ids, [t.logprob for t in out.logprobs]


def _joined(model, target: GenerationRequest, width: int, before=()) -> object:
    """`target` arriving at step 2 into a batch running `width - 1` others (half from step 0,
    the rest joining while it decodes, at steps 4-9), after the requests `before` (step 0)."""
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=8 + i % 9, temperature=0.0))
              for i, p in enumerate(_prompts(width - 1, width))]  # fmt: skip
    first = (width - 1) // 2
    work = [(0, r) for r in before] + [(0, r) for r in others[:first]] + [(2, target)]
    work += [(4 + i % 6, r) for i, r in enumerate(others[first:])]
    return staggered(engine(model, **CFG), work)[target.request_id]


@pytest.fixture(scope="module", params=FORMATS)
def model(request):
    return request.param, _model(request.param)


@pytest.mark.parametrize("width", [1, 2, 8, 48])
def test_a_request_gives_the_same_bits_alone_and_in_running_batches(model, width):
    fmt, m = model
    target = _prompts(1, 99)[0]
    (alone,) = engine(m, simple=True, **CFG).generate([GenerationRequest("x", target, PARAMS)])
    got = _joined(m, GenerationRequest("x", target, PARAMS), width)
    assert _bits(got) == _bits(alone)


@pytest.mark.parametrize("width", [2, 8, 48])
def test_the_same_bits_when_prompts_arrive_together(model, width):
    """The target's 150-token prompt prefilled in the same step as the others' (up to 230
    tokens: the engine's context is 256), each chunk attending alone, not padded into a batch
    of chunks (whose tiles gave 22 of 150 rows other bits beside a 300-token chunk); then
    decoding among them."""
    fmt, m = model
    target = np.random.default_rng(98).integers(1, 49152, size=150).tolist()
    (alone,) = engine(m, simple=True, **CFG).generate([GenerationRequest("x", target, PARAMS)])
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=8 + i % 9, temperature=0.0))
              for i, p in enumerate(_prompts(width - 1, width, longest=230))]  # fmt: skip
    batch = [*others[: width // 2], GenerationRequest("x", target, PARAMS), *others[width // 2 :]]
    (got,) = [o for o in engine(m, **CFG).generate(batch) if o.request_id == "x"]
    assert _bits(got) == _bits(alone)


def test_the_same_bits_behind_a_prefix_cache_hit_alone_and_in_a_batch(model):
    """A sibling sharing the target's first 70 tokens runs first: the target's prompt hits its
    first whole tile (8 blocks: the rest of a prompt's last tile is hashed with its length,
    core/kv_manager.py) in simple mode and in a running batch alike (no neighbour shares it:
    no cascade)."""
    fmt, m = model
    rng = np.random.default_rng(7)
    shared = rng.integers(1, 49152, size=70).tolist()
    sibling = GenerationRequest(
        "s", shared + [5, 6, 7], SamplingParams(max_tokens=1, temperature=0.0)
    )
    target = shared + rng.integers(1, 49152, size=13).tolist()
    alone = engine(m, simple=True, **CFG).generate(
        [sibling, GenerationRequest("x", target, PARAMS)]
    )[1]
    assert alone.cached_tokens == 64
    got = _joined(m, GenerationRequest("x", target, PARAMS), 8, before=[sibling])
    assert got.cached_tokens == 64
    assert _bits(got) == _bits(alone)


@pytest.mark.parametrize("shared, extra, rest, hit",
                         [(40, 1, 1, 40), (40, 2, 1, 32), (72, 1, 90, 64), (72, 60, 90, 72),
                          (130, 1, 1, 128), (150, 10, 60, 144)])  # fmt: skip
def test_the_same_bits_with_and_without_a_prefix_cache_hit(model, shared, extra, rest, hit):
    """A request's prompt (`shared` + `rest` tokens) computed whole (a fresh engine), and
    with its first `hit` tokens taken from the prefix cache, left there by a sibling (`shared`
    + `extra` tokens), only the rest computed. A hit ends where the sibling's last whole
    16-token tile (attention.TILE_QUERIES) and the request's own do, at most: the rows of a
    prompt's last, partial tile attend over keys up to its end, so their KV depends on its
    length (40 + 2 behind 40: the tile from 32 summed 42 keys where the request's own sums
    41); those blocks are hashed with the prompt's length (core/kv_manager.py): hit by a
    prompt as long (40 + 1 behind 40 + 1), not by another (40 + 1 behind 40 + 2: 32 of the 40
    shared tokens). `rest` = 1: one prompt token, laid out as a chunk, not beside the decodes;
    90 after a hit of 72: a hit ending mid-tile (blocks of 8).
    9 of 16 short chats' texts differed in int8 and 4 in bf16 behind the chat template's
    cached system prompt, before the tiles were aligned and padded (attention.py)."""
    fmt, m = model
    rng = np.random.default_rng(shared + extra + rest)
    common = rng.integers(1, 49152, size=shared).tolist()
    target = common + rng.integers(1, 49152, size=rest).tolist()
    sibling = GenerationRequest("s", common + rng.integers(1, 49152, size=extra).tolist(),
                                SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
    (whole,) = engine(m, **CFG).generate([GenerationRequest("x", target, PARAMS)])
    got = engine(m, **CFG).generate([sibling, GenerationRequest("x", target, PARAMS)])[1]
    assert (whole.cached_tokens, got.cached_tokens) == (0, hit)
    assert _bits(got) == _bits(whole)


@pytest.mark.parametrize("before", [37, 90])
def test_the_same_bits_when_the_step_budget_cuts_the_prompt_elsewhere(model, before):
    """A 230-token prompt under a 160-token step budget: alone it is cut at 160; arriving
    behind a `before`-token prompt in the same step, where the budget left and the decodes
    beside it say. The cuts end on the attention's 16-query tiles (attention.TILE_QUERIES,
    SchedulerConfig.chunk_align), so each row attends in the tile it would alone; cut
    where the budget ran out, the tile ending at the cut saw fewer keys (1 of 3 requests'
    log-probs differed so at float32 in `benchmarks.invariance --quick`)."""
    fmt, m = model
    cfg = {**CFG, "max_prefill_tokens": 160}
    rng = np.random.default_rng(before)
    target = rng.integers(1, 49152, size=230).tolist()
    first = GenerationRequest("o", rng.integers(1, 49152, size=before).tolist(),
                              SamplingParams(max_tokens=6, temperature=0.0))  # fmt: skip
    solo = engine(m, simple=True, **cfg)
    solo_ends = _chunk_ends(solo, "x")
    (alone,) = solo.generate([GenerationRequest("x", target, PARAMS)])
    eng = engine(m, **cfg)
    ends = _chunk_ends(eng, "x")
    got = eng.generate([first, GenerationRequest("x", target, PARAMS)])[1]
    assert solo_ends == [160, 230] and ends != solo_ends
    assert all(e % 16 == 0 for e in ends[:-1]), ends
    assert _bits(got) == _bits(alone)


def _chunk_ends(eng, rid: str) -> list[int]:
    """The positions where request `rid`'s prompt chunks end, filled in as `eng` runs."""
    ends: list[int] = []
    sched = eng.runner.scheduler
    schedule = sched.schedule

    def recording():
        step = schedule()
        ends.extend(s.start + s.num_new_tokens for s in (step.seqs if step else [])
                    if s.seq.seq_id == rid and not s.decode)  # fmt: skip
        return step

    sched.schedule = recording
    return ends


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_same_bits_after_a_preemption(model, prefix_cache):
    """Eight requests in a pool of 24 blocks of 8 (room for three or four at once): several
    are preempted mid-decode and resume. Each gives simple mode's bits: its prompt recomputed
    in prompt chunks, its generated tokens fed back one a step as decode rows (or taken from
    the prefix cache as whole blocks), as they were first computed
    (SchedulerConfig.replay_decodes); recomputed in one prompt chunk instead, 6 of 8 requests'
    log-probs were bit-equal on this model at bf16 (docs/engine.md)."""
    fmt, m = model
    cfg = {**CFG, "use_paged_cache": prefix_cache}
    reqs = [GenerationRequest(f"r{i}", p, PARAMS) for i, p in enumerate(_prompts(8, 5))]
    alone = engine(m, simple=True, **cfg).generate(reqs)
    small = {**cfg, "memory_aware": False, "cache_max_blocks": 24, "adaptive_width": False}
    eng = engine(m, **small)
    got = eng.generate(reqs)
    stats = eng.runner.scheduler.stats
    assert stats.preemptions >= 2 and stats.replayed_tokens > 0
    assert [_bits(o) for o in got] == [_bits(o) for o in alone]


@pytest.mark.slow
@pytest.mark.real_model
def test_real_model_chats_give_the_same_bits_alone_and_in_running_batches(default_model):
    """The default model at the default dtype: 6 chats, each alone in simple mode, then each
    joining a batch of 7 or 23 others (the system prompt is shorter than the cascade's 8 blocks)."""
    from tests.engine.test_engine_real import QUESTIONS, chat_ids, make_engine

    tok = default_model.tokenizer
    eos = default_model.eos_token_ids
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=True, top_logprobs=2)
    questions = QUESTIONS + ["Say hello.", "Write a haiku about the sea."]
    prompts = [chat_ids(tok, q) for q in questions]
    simple = make_engine(default_model, simple=True)
    alone = simple.generate(
        [GenerationRequest(f"x{i}", p, params, eos) for i, p in enumerate(prompts)]
    )
    for width in (8, 24):
        for i, p in enumerate(prompts):
            others = [GenerationRequest(f"o{j}", chat_ids(tok, f"Count to {j + 3}.", system=None),
                                        SamplingParams(max_tokens=6 + j % 11, temperature=0.0), eos)
                      for j in range(width - 1)]  # fmt: skip
            work = [(0, r) for r in others[: width // 2]] + [
                (2, GenerationRequest("x", p, params, eos))
            ]
            work += [(4 + j % 5, r) for j, r in enumerate(others[width // 2 :])]
            e = make_engine(default_model, max_batch_size=64, max_prefill_tokens=8192)
            got = staggered(e, work)["x"]
            assert _bits(got) == _bits(alone[i]), (width, questions[i])


def test_float32_runs_on_the_host_where_onednn_has_brgemm_kernels():
    """`--dtype float32` takes the float32 host format (host steps: batch-invariant) where
    oneDNN has float32 brgemm kernels, MLX's own float32 elsewhere."""
    from batchmlx.engine.models.loader import host_format

    want = HostFormat.F32 if _oneDNN_float32() else None
    assert host_format("float32", on_cpu=True) is want
    assert host_format("float32", on_cpu=False) is None


def test_without_cascade_attention_the_same_bits_behind_a_shared_prompt(model):
    """Eight requests behind one 96-token prompt (12 blocks of 8, past MIN_CASCADE_BLOCKS):
    with cascade_attention off each decodes over its own keys, and gives simple mode's bits
    (the same prefix-cache hits both ways: the first computes the prompt, the others hit it)."""
    fmt, m = model
    rng = np.random.default_rng(11)
    shared = rng.integers(1, 49152, size=96).tolist()
    reqs = [GenerationRequest(f"r{i}", shared + rng.integers(1, 49152, size=3 + 2 * i).tolist(),
                              PARAMS) for i in range(8)]  # fmt: skip
    alone = engine(m, simple=True, **CFG).generate(reqs)
    got = engine(m, cascade_attention=False, **CFG).generate(reqs)
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in alone]
    assert [_bits(o) for o in got] == [_bits(o) for o in alone]


def test_the_cascade_gives_the_same_bits_behind_a_shared_prompt(model):
    """The same eight requests with cascade attention on: their decode rows read the shared
    prompt's blocks block-major, once for all of them, in the paged kernel
    (engine/host/paged_attention.py), with each row's arithmetic that of the row alone. The
    prompt is 128 tokens, two whole tiles: requests behind it hit all of it (a prompt's last,
    partial tile is hashed with its length, core/kv_manager.py: behind 96 they hit 64)."""
    if paged_attention.library() is None:
        pytest.skip("the paged decode kernel does not run on this CPU")
    fmt, m = model
    rng = np.random.default_rng(11)
    shared = rng.integers(1, 49152, size=128).tolist()
    reqs = [GenerationRequest(f"r{i}", shared + rng.integers(1, 49152, size=3 + 2 * i).tolist(),
                              PARAMS) for i in range(8)]  # fmt: skip
    alone = engine(m, simple=True, **CFG).generate(reqs)
    e = engine(m, **CFG)
    rows = []
    real, layer = paged_attention.decode, paged_attention.DecodeStep.layer
    with pytest.MonkeyPatch.context() as mp:  # the steps' decode rows, to see the cascade ran
        mp.setattr(paged_attention, "decode", lambda q, k, v, r, *a, **kw: (
            rows.append(r.shared), real(q, k, v, r, *a, **kw))[1])  # fmt: skip
        mp.setattr(paged_attention.DecodeStep, "layer", lambda self, *a: (
            rows.append(self.rows.shared), layer(self, *a))[1])  # fmt: skip
        got = e.generate(reqs)
    assert max(rows) >= 16  # the prompt's 16 blocks of 8, read once a step for all rows
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in alone]
    assert [_bits(o) for o in got] == [_bits(o) for o in alone]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_mixture_of_experts_gives_the_same_bits_alone_and_in_running_batches(fmt):
    """A qwen3_moe request alone and joining a running batch of 8, then of 48 (its tokens
    routed beside others' to the same experts, each expert's GEMM of another M), and with
    prompts arriving together: the same tokens and log-probs, bit for bit, on the host step."""
    m = _moe_model(fmt)
    target = _prompts(1, 99)[0]
    (alone,) = engine(m, simple=True, **CFG).generate([GenerationRequest("x", target, PARAMS)])
    for width in (8, 48):
        got = _joined(m, GenerationRequest("x", target, PARAMS), width)
        assert _bits(got) == _bits(alone), width
    others = [GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=8, temperature=0.0))
              for i, p in enumerate(_prompts(7, 3, longest=200))]  # fmt: skip
    batch = [*others[:3], GenerationRequest("x", target, PARAMS), *others[3:]]
    eng = engine(m, **CFG)
    (got,) = [o for o in eng.generate(batch) if o.request_id == "x"]
    assert _bits(got) == _bits(alone)
    assert eng.runner.forward_pass.host is not None  # the host step ran it


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_invariance_check_finds_no_difference_on_a_random_model(fmt):
    """`python -m benchmarks.invariance --quick`: 24 mixed requests (shared prefixes, prompts
    the 256-token step budget cuts) alone, all at once, and at width 16 in a pool that
    preempts; every run gives simple mode's tokens and log-probs."""
    from benchmarks import invariance

    make, reqs = invariance.quick_model(fmt.value, 24)
    simple, batch, narrow = invariance.measure(make, reqs, narrow=True, cascade=True)
    assert simple.prefix_hits > 0 and narrow.preemptions > 0
    for run in (batch, narrow):
        assert (run.tokens_differ, run.logprobs_differ) == (0, 0), run.differ
