"""Batch invariance as a user meets it (issue 47): N mixed chats, each run alone in simple mode
(`worker --simple`: one request at a time) and then all of them at once in the continuous
engine, and again at a narrow running width in a small KV pool that forces preemptions; how
many differ from simple mode's greedy tokens and log-probs, with each one's first differing
position.

The chats: a third behind one of three system prompts (~80, ~190 and ~330 tokens: the later
chats of a prompt hit the prefix cache in every run), the rest without; user messages of 5 to
~900 words, so that with all of them submitted at once the step's token budget (2,048) cuts
prompts; 16 to 48 new tokens each, greedy, with log-probs. The model is built the way the
worker builds it (`worker.build.build_engine`), once a run.

    python -m benchmarks.invariance [--dtype D] [--requests 80] [--model default]
        [--no-narrow] [--cascade on|off] [--json]
    python -m benchmarks.invariance --quick   # a 2-layer random model, 24 requests (tests)

Exit status 0 whatever the figures (it measures; the tests pin invariance).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationOutput, GenerationRequest, SamplingParams

SYSTEMS = (
    "You are a helpful assistant. Answer briefly and plainly.",
    "You are a patient tutor for students of history and geography. Explain each answer step "
    "by step, name the places and the dates, say where sources disagree, and end with one "
    "question the student could ask next. Keep a friendly tone. " * 2,
    "You are the support desk of a small company that sells garden tools. Be polite, be "
    "precise, never promise refunds, and point customers to the manual when a question is "
    "about assembly. Shipping takes five working days; returns are accepted for thirty days "
    "with the receipt. Our opening hours are nine to five, Monday to Friday. " * 3,
)
WORDS = (
    "river mountain city winter garden history letter music window science travel question "
    "market bread lantern engine harbour forest castle teacher number library summer ocean "
    "bridge island village story machine rain season painting"
).split()
NARROW_WIDTH = 16  # the preempting run's running width
NARROW_CACHE_MB = 48  # its KV pool (the default model's KV: ~46 KB a token in float32)


@dataclass(slots=True)
class Differs:
    """One request whose run differs from simple mode's."""

    request_id: str
    first_token: int | None  # first position whose greedy token differs (None: all equal)
    first_logprob: int | None  # first position whose log-prob differs in any bit
    max_logprob_diff: float  # over the positions both runs have, tokens equal or not
    preempted: int = 0  # times it was preempted in that run
    cached_tokens: int = 0  # prompt tokens it took from the prefix cache in that run


@dataclass(slots=True)
class Run:
    name: str
    requests: int
    tokens_differ: int = 0
    logprobs_differ: int = 0
    preemptions: int = 0
    replayed_tokens: int = 0  # generated tokens fed back as decode rows after preemptions
    prefix_hits: int = 0  # requests that took prompt tokens from the prefix cache
    seconds: float = 0.0
    differ: list[Differs] = field(default_factory=list)


def chats(tokenizer: Any, n: int, seed: int = 0) -> list[list[int]]:
    """n chat prompts as token ids (the tokenizer's chat template)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = int(rng.choice([5, 20, 60, 150, 400, 900], p=[0.2, 0.25, 0.25, 0.15, 0.1, 0.05]))
        user = "Tell me about " + " ".join(rng.choice(WORDS, size=words)) + "."
        system = SYSTEMS[i % 3] if i % 3 != 0 or i % 2 == 0 else None
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def requests(prompts: list[list[int]], eos: tuple[int, ...] = ()) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}",
            p,
            SamplingParams(max_tokens=16 + (i * 7) % 33, temperature=0.0, logprobs=True),
            eos,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]


def compare(name: str, want: list[GenerationOutput], got: list[GenerationOutput],
            preempted: dict[str, int], seconds: float) -> Run:  # fmt: skip
    run = Run(name, len(want), seconds=seconds)
    run.preemptions = sum(preempted.values())
    by_id = {o.request_id: o for o in got}
    for w in want:
        g = by_id[w.request_id]
        run.prefix_hits += g.cached_tokens > 0
        wl = [t.logprob for t in w.logprobs or []]
        gl = [t.logprob for t in g.logprobs or []]
        ft = _first(w.token_ids, g.token_ids)
        fl = _first(wl, gl)
        if ft is None and fl is None:
            continue
        both = min(len(wl), len(gl))
        diff = float(np.max(np.abs(np.subtract(wl[:both], gl[:both])))) if both else 0.0
        run.tokens_differ += ft is not None
        run.logprobs_differ += fl is not None
        run.differ.append(Differs(w.request_id, ft, fl, diff, preempted.get(w.request_id, 0),
                                  g.cached_tokens))  # fmt: skip
    return run


def _first(a: list, b: list) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if i is None and len(a) != len(b):
        return min(len(a), len(b))
    return i


def _run(engine: Any, reqs: list[GenerationRequest]) -> tuple[list, dict[str, int], float]:
    """Every request at once; (outputs, preemptions by request id, seconds)."""
    seen: dict[str, int] = {}
    sched = engine.runner.scheduler
    for r in reqs:
        engine.add(r)
    outs: list[GenerationOutput] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for s in sched.running:
            seen[s.seq_id] = s.num_preemptions
        outs.extend(engine.step())
    return outs, {k: v for k, v in seen.items() if v}, time.perf_counter() - t0


def measure(make: Any, reqs: list[GenerationRequest], narrow: bool, cascade: bool) -> list[Run]:
    """make(settings) -> an engine. Simple mode first, then all at once, then narrow."""
    t0 = time.perf_counter()
    alone = make(EngineSettings(simple=True, cascade_attention=cascade)).generate(reqs)
    base_s = time.perf_counter() - t0
    out = [Run("simple", len(reqs), seconds=base_s)]
    out[0].prefix_hits = sum(o.cached_tokens > 0 for o in alone)
    wide = make(EngineSettings(cascade_attention=cascade))
    out.append(compare("batch", alone, *_run(wide, reqs)))
    out[-1].replayed_tokens = wide.runner.scheduler.stats.replayed_tokens
    if narrow:
        narrow_cfg = EngineSettings(
            max_batch_size=NARROW_WIDTH,
            adaptive_width=False,
            cache_memory_mb=NARROW_CACHE_MB,
            cascade_attention=cascade,
        )
        e = make(narrow_cfg)
        out.append(compare(f"width {NARROW_WIDTH}, small KV pool", alone, *_run(e, reqs)))
        out[-1].replayed_tokens = e.runner.scheduler.stats.replayed_tokens
    return out


def default_model(name: str, dtype: str, n: int) -> tuple[Any, list[GenerationRequest]]:
    from batchmlx.worker.build import build_engine
    from benchmarks.peers.models import BMX_CACHE

    def make(settings: EngineSettings) -> Any:
        return build_engine(name, cache_dir=BMX_CACHE, dtype=dtype, settings=settings).engine

    first = build_engine(name, cache_dir=BMX_CACHE, dtype=dtype, settings=EngineSettings())
    tok = first.translator.tok
    eos = tuple(sorted(first.translator.eos_ids))
    return make, requests(chats(tok, n), eos)


def quick_model(dtype: str, n: int) -> tuple[Any, list[GenerationRequest]]:
    """A 2-layer random llama (vocabulary 97) in the host format `dtype` asks for; prompts of
    random ids, a third behind one of two shared 40- and 100-token prefixes, some of 150-300
    tokens (the step budget here: 256; the narrow run's KV pool: 64 blocks of 8), 12 new
    tokens each."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    from batchmlx.engine.host.linear import to_host_format
    from batchmlx.engine.models.loader import host_format
    from batchmlx.engine.runners.paged import paged_engine

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           vocab_size=97, rms_norm_eps=1e-5, rope_theta=10000.0,
                           tie_word_embeddings=True)  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda p: p * 4.0, model.parameters()))
    mx.eval(model.parameters())
    fmt = host_format(dtype, on_cpu=True)
    if fmt is not None:
        to_host_format(model, fmt)
    rng = np.random.default_rng(0)
    shared = [rng.integers(1, 97, size=k).tolist() for k in (40, 100)]
    prompts = []
    for i in range(n):
        own = rng.integers(1, 97, size=int(rng.choice([3, 20, 70, 150, 300]))).tolist()
        prompts.append((shared[i % 2] if i % 3 == 0 else []) + own)
    reqs = [GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                         logprobs=True))
            for i, p in enumerate(prompts)]  # fmt: skip

    def make(settings: EngineSettings) -> Any:
        narrow = settings.max_batch_size == NARROW_WIDTH
        small = dict(block_size=8, max_prefill_tokens=256, max_batch_size=64, cache_memory_mb=64)
        if narrow:  # 64 blocks of 8: room for the longest alone, not for 16 at once
            small = {
                **small,
                "max_batch_size": NARROW_WIDTH,
                "memory_aware": False,
                "cache_memory_mb": None,
                "cache_max_blocks": 64,
            }
        cfg = EngineSettings(**{**asdict(settings), **small})
        return paged_engine(model, None, context_length=512, config=cfg, seed=0)

    return make, reqs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="auto", help="batchmlx's --dtype (default auto)")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--model", default="default")
    p.add_argument("--quick", action="store_true", help="a 2-layer random model (tests)")
    p.add_argument("--no-narrow", action="store_true", help="skip the preempting run")
    p.add_argument(
        "--cascade",
        choices=["on", "off"],
        default="on",
        help="cascade attention of shared prefixes (EngineSettings; default on)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line")
    args = p.parse_args(argv)
    if args.quick:
        make, reqs = quick_model(args.dtype, min(args.requests, 24))
    else:
        make, reqs = default_model(args.model, args.dtype, args.requests)
    runs = measure(make, reqs, not args.no_narrow, args.cascade == "on")
    result = {"dtype": args.dtype, "model": "quick" if args.quick else args.model,
              "requests": len(reqs), "cascade": args.cascade,
              "runs": [asdict(r) for r in runs]}  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    for r in runs:
        print(f"{r.name}: {r.requests} requests, {r.prefix_hits} with a prefix hit, "
              f"{r.preemptions} preemptions ({r.replayed_tokens} tokens replayed), "
              f"{r.seconds:.1f} s: tokens differ in "
              f"{r.tokens_differ}, log-probs in {r.logprobs_differ}")  # fmt: skip
        for d in r.differ:
            print(f"  {d.request_id}: first token at {d.first_token}, first log-prob at "
                  f"{d.first_logprob} (max |diff| {d.max_logprob_diff:.2e}), preempted "
                  f"{d.preempted}x, cached {d.cached_tokens}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
