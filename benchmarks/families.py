"""Every host family beside llama at one size and workload, whole process (issue 48's first target:
each within 1.15x of llama's whole-process time).

    python -m benchmarks.families [--families llama,qwen3,...] [--rounds 3] [--json F]
                                  [--out benchmarks/RESULTS-families.md]

Each family is a random-weight model of the default model's shape (SmolLM2-135M: hidden 576, 30
layers, 9 query and 3 KV heads of 64, MLP 1,536, its 49,152-token vocabulary, tokenizer and chat
template, tied embeddings) built from mlx-lm's own class of that model_type, bf16, saved once as
an MLX folder under ~/.cache/batchmlx-bench/models; the mixture of experts (qwen3_moe) has the
same active size: 8 experts of 768, 2 a token. Each run is `batchmlx submit --model FOLDER --wait`
then `results -o` as a fresh process (benchmarks/peers/run_peer.py's run_batchmlx), defaults
(`--dtype auto`), on 32 chats x 64 new tokens, greedy. Every family runs once untimed first (its
packed weights are then on disk: a warm start), then `--rounds` rounds, the families in turn in
each round, so a slow spell of a shared machine hits every family alike. Per family: the median
whole-process seconds, the median steady tok/s (completion tokens from "weights loaded" to the
end) and the ratio of its median wall to llama's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.whole_process import Workload

WORKLOAD = Workload("families", 32, 64, None)
TARGET = 1.15  # issue 48: each family's whole process within this of llama's
_SHAPE: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "intermediate_size": 1536, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "torch_dtype": "bfloat16",
}  # fmt: skip
# What each family sets beyond the shape: its model_type and the parts its real checkpoints have.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    # Ministral's kind of mistral (mlx-lm loads mistral as llama): sliding-window (4,096) and
    # full layers alternating (llama's class needs one full layer)
    "mistral": {"sliding_window": 4096,
                "layer_types": ["sliding_attention", "full_attention"] * 15},
    "qwen2": {"model_type": "qwen2"},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "rms_norm_eps": 1e-6},  # q/k norms
    "gemma2": {"model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh",
               "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6},
    "gemma3_text": {"model_type": "gemma3_text", "hidden_act": "gelu_pytorch_tanh",
                    "query_pre_attn_scalar": 64, "sliding_window": 512,
                    "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                    "rms_norm_eps": 1e-6},
    "phi3": {"model_type": "phi3"},  # fused qkv and gate_up
    "granite": {"model_type": "granite", "attention_multiplier": 0.015625,
                "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "logits_scaling": 2.25, "attention_bias": False, "mlp_bias": False},
    "olmo2": {"model_type": "olmo2"},  # norms after each sublayer, q/k norms over all heads
    "smollm3": {"model_type": "smollm3", "no_rope_layer_interval": 4},
    # the same active MLP as llama's 1,536: 2 of 8 experts of 768 (docs/models.md)
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6},
}  # fmt: skip


def log(msg: str) -> None:
    print(f"[families] {msg}", file=sys.stderr, flush=True)


def config_of(family: str) -> dict[str, Any]:
    return _SHAPE | FAMILIES[family]


def folder_of(family: str) -> Path:
    from benchmarks.peers.models import MODELS, random_folder

    return random_folder(config_of(family), MODELS / f"random-135m-{family}-mlx-bf16")


@dataclass(slots=True)
class Run:
    """One timed whole process of one family."""

    family: str
    wall_s: float  # spawn to results written
    steady_tok_s: float  # completion tokens / (end - weights loaded)
    tokens: int
    precision: str  # the loader's "weights as ..."
    mlx_steps: str | None = None  # the log's reason when steps ran in MLX


@dataclass(frozen=True, slots=True)
class Row:
    family: str
    walls: tuple[float, ...]
    wall_s: float  # median
    steady_tok_s: float  # median
    tokens: int  # the fewest of any round (random weights may emit eos early)
    ratio: float  # wall_s / llama's wall_s
    # the median of each round's wall / llama's in that round (a slow spell that lasts a
    # round moves both)
    round_ratio: float
    precision: str
    mlx_steps: str | None

    @property
    def within(self) -> bool:
        return self.ratio <= TARGET


def summarize(runs: list[Run], reference: str = "llama") -> list[Row]:
    """Per family (in first-run order) its medians and the ratio of its median wall to
    `reference`'s; and the median of its per-round ratios (a family's n-th run against the
    reference's n-th)."""
    by: dict[str, list[Run]] = {}
    for r in runs:
        by.setdefault(r.family, []).append(r)
    if reference not in by:
        raise ValueError(f"no runs of the reference family {reference!r}")
    refs = [r.wall_s for r in by[reference]]
    ref = statistics.median(refs)
    rows = []
    for fam, rs in by.items():
        wall = statistics.median(r.wall_s for r in rs)
        per_round = statistics.median(r.wall_s / w for r, w in zip(rs, refs, strict=False))
        rows.append(Row(fam, tuple(r.wall_s for r in rs), wall,
                        statistics.median(r.steady_tok_s for r in rs),
                        min(r.tokens for r in rs), wall / ref, per_round, rs[0].precision,
                        next((r.mlx_steps for r in rs if r.mlx_steps), None)))  # fmt: skip
    return rows


def table(rows: list[Row], requested_tokens: int) -> list[str]:
    lines = ["| family | whole process s (median) | rounds s | steady tok/s | completion "
             "tokens | against llama | within 1.15x | round by round |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        rounds = ", ".join(f"{w:.1f}" for w in r.walls)
        short = "" if r.tokens == requested_tokens else f" (of {requested_tokens})"
        mlx = f" (MLX steps: {r.mlx_steps})" if r.mlx_steps else ""
        lines.append(f"| {r.family}{mlx} | {r.wall_s:.2f} | {rounds} | {r.steady_tok_s:.1f} | "
                     f"{r.tokens}{short} | **{r.ratio:.2f}x** | "
                     f"{'yes' if r.within else 'no'} | {r.round_ratio:.2f}x |")  # fmt: skip
    return lines


def run_once(family: str, folder: Path) -> Run:
    from benchmarks.peers.run_peer import run_batchmlx

    r = run_batchmlx(WORKLOAD, folder=folder)
    return Run(family, r.wall_s, r.steady_tok_s, r.output_tokens, r.precision,
               r.extra.get("mlx_steps"))  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepPair:
    """One family's decode steps beside llama's, in one process, stepped in turn."""

    family: str
    llama_ms: float  # median decode step
    family_ms: float

    @property
    def ratio(self) -> float:
        return self.family_ms / self.llama_ms


STEP_SKIP = 4  # the first steps (the prompts' prefill) and as many at the end (rows finishing)


def decode_median(steps: list[float]) -> float:
    """The median of a run's steps in ms, its first and last STEP_SKIP left out."""
    inner = steps[STEP_SKIP:-STEP_SKIP] if len(steps) > 2 * STEP_SKIP else steps
    return statistics.median(inner) * 1000


def _engine(family: str, width: int, tokens: int) -> Any:
    """An engine on the family's folder (`--dtype auto`) holding `width` of the workload's chats,
    greedy, `tokens` new tokens each."""
    from batchmlx.core.engine_api import ENGINE_DEFAULTS
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.worker.build import build_engine
    from benchmarks.whole_process import CACHE

    engine = build_engine(str(folder_of(family)), cache_dir=CACHE, dtype="auto",
                          settings=ENGINE_DEFAULTS).engine  # fmt: skip
    tok = engine.tokenizer
    for i, chat in enumerate(WORKLOAD.messages(tok)[:width]):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        engine.add(GenerationRequest(f"r{i}", ids, SamplingParams(max_tokens=tokens,
                                                                  temperature=0.0)))  # fmt: skip
    return engine


def step_pair(family: str, width: int = 32, tokens: int = 48) -> StepPair:
    """llama's and `family`'s engines in this process, one step of each in turn until both are
    done (a slow spell of a shared machine hits both alike): their median decode steps."""
    import gc

    engines = {"llama": _engine("llama", width, tokens), family: _engine(family, width, tokens)}
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        for name, e in engines.items():
            if e.has_unfinished():
                t = time.perf_counter()
                list(e.step())
                times[name].append(time.perf_counter() - t)
    del engines
    gc.collect()
    return StepPair(family, decode_median(times["llama"]), decode_median(times[family]))


def step_table(pairs: list[StepPair], width: int) -> list[str]:
    lines = [f"| family | llama decode step ms | its decode step ms (width {width}) | "
             "against llama |", "|---|---|---|---|"]  # fmt: skip
    for p in pairs:
        lines.append(f"| {p.family} | {p.llama_ms:.1f} | {p.family_ms:.1f} | "
                     f"**{p.ratio:.2f}x** |")  # fmt: skip
    return lines


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {len(os.sched_getaffinity(0))} CPUs"


def loadavg() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (5-min {five:.1f})"


def measure(families: list[str], rounds: int) -> tuple[list[Run], list[str]]:
    folders = {f: folder_of(f) for f in families}
    loads = [f"start {loadavg()}"]
    for fam in families:  # warm: packs each model's weights into the cache once
        log(f"{fam}: warm-up run")
        run_once(fam, folders[fam])
    runs = []
    for i in range(rounds):
        for fam in families:
            r = run_once(fam, folders[fam])
            log(f"round {i + 1}/{rounds} {fam}: {r.wall_s:.2f} s, {r.steady_tok_s:.1f} tok/s, "
                f"{r.tokens} tokens, load {loadavg()}")  # fmt: skip
            runs.append(r)
        loads.append(f"after round {i + 1} {loadavg()}")
    return runs, loads


def page(rows: list[Row], loads: list[str], argv: list[str],
         pairs: list[StepPair] | None = None, width: int = 32) -> list[str]:  # fmt: skip
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    return [
        "# Every host family beside llama, whole process", "",
        f"`python -m benchmarks.families {' '.join(argv)}`".replace(" `", "`"),
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {rev}). "
        f"{machine()}; load average {'; '.join(loads)}.", "",
        "Random bf16 weights of the default model's shape (hidden 576, 30 layers, 9 query and 3 "
        "KV heads of 64, MLP 1,536; qwen3_moe: 2 of 8 experts of 768, the same active size), "
        "each from mlx-lm's own class of its family, with the default model's tokenizer. "
        f"{WORKLOAD.requests} chats x {WORKLOAD.max_tokens} new tokens, greedy, "
        "`submit --model FOLDER --wait` + `results -o` as fresh processes, `--dtype auto`, warm "
        "(each family run once first). Families in turn each round; medians. Steady tok/s = "
        "completion tokens / (end - the weights-loaded log line).", "",
        *(table(rows, WORKLOAD.requests * WORKLOAD.max_tokens) if rows else []), "",
    ] + ([] if not pairs else [
        f"Decode steps beside llama's (`--steps`): each family's engine and llama's in one "
        f"process, {width} of the same chats each, one step of each in turn; the median decode "
        f"step, the first and last {STEP_SKIP} steps left out. On a shared machine this ratio "
        "moves far less than the whole processes' walls.", "",
        *step_table(pairs, width), "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated, of {', '.join(FAMILIES)}")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write every run here")
    p.add_argument("--out", help="write the page here (e.g. benchmarks/RESULTS-families.md)")
    p.add_argument(
        "--steps",
        action="store_true",
        help="also each family's decode steps beside llama's, in one process",
    )
    p.add_argument("--width", type=int, default=32, help="--steps: chats at once")
    p.add_argument("--no-process", action="store_true", help="--steps only")
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    if "llama" not in families:
        families.insert(0, "llama")  # the reference
    runs, loads = (
        ([], [f"start {loadavg()}"]) if args.no_process else measure(families, args.rounds)
    )
    pairs = []
    for fam in families if args.steps else []:
        if fam != "llama":
            pairs.append(step_pair(fam, args.width))
            log(f"steps: {fam} {pairs[-1].ratio:.2f}x llama's, load {loadavg()}")
    loads.append(f"end {loadavg()}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"runs": [asdict(r) for r in runs], "steps": [asdict(p) for p in pairs]}, indent=2
            )
        )
    lines = page(summarize(runs) if runs else [], loads, argv, pairs, args.width)
    if args.out:
        Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
