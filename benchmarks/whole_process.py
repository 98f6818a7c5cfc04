"""Whole-process throughput: a batch file in, results in hand, timed from process start.

`python -m benchmarks.whole_process` writes benchmarks/RESULTS-process.md. Each system runs as
its own process, the way a user runs it, and is timed from spawn to exit (model load, tokenizer,
queue and files included):

- batchmlx at its defaults: `batchmlx submit FILE --wait` in a fresh home, then
  `batchmlx results ID -o out.jsonl`, its sources byte-compiled first as an install's are;
- optionally the same commands from an earlier commit (`--baseline REV`, exported with
  `git archive`), so "before" and "after" are measured side by side in one run;
- `mlx_lm.batch_generate` with its defaults on float32 weights (the weights batchmlx runs), in a
  script that loads the model, applies the chat template and writes the texts, under the same
  BLAS (both sides re-execute onto the fast BLAS the same way).

Workloads: unique prompts (64 different questions, up to 128 new tokens) and a shared system
prompt (64 requests behind one ~900-token system prompt, up to 32 new tokens). Greedy, stopping at
eos on every side, so the work is equal when the texts are equal: the report says how many are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from benchmarks.workloads import question, system_prompt

CACHE = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()
REPO = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"[process-bench] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: int
    max_tokens: int
    system_tokens: int | None  # a shared system prompt of about this many tokens, or none

    def messages(self, tokenizer: Any) -> list[list[dict[str, str]]]:
        system = system_prompt(tokenizer, self.system_tokens) if self.system_tokens else None
        out = []
        for i in range(self.requests):
            m = [{"role": "user", "content": question(i)}]
            if system:
                m.insert(0, {"role": "system", "content": system})
            out.append(m)
        return out

    def batch_file(self, tokenizer: Any) -> bytes:
        lines = []
        for i, m in enumerate(self.messages(tokenizer)):
            body = {"model": "default", "messages": m, "max_tokens": self.max_tokens,
                    "temperature": 0}  # fmt: skip
            lines.append(orjson.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": body}
            ))  # fmt: skip
        return b"\n".join(lines) + b"\n"


@dataclass(slots=True)
class ProcessRun:
    system: str
    wall_s: float  # the best of `walls`
    texts: dict[str, str]  # custom_id -> generated text
    output_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    walls: list[float] = field(default_factory=list)  # every run's wall, in order
    unstable: int = 0  # texts that differed between this system's runs (should stay 0)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def merge(self, again: ProcessRun) -> None:
        """Another run of the same system: the best wall counts, every wall is shown."""
        self.walls = [*(self.walls or [self.wall_s]), again.wall_s]
        self.wall_s = min(self.walls)
        self.unstable += sum(1 for k, v in self.texts.items() if again.texts.get(k) != v)


def _env(home: str | None = None, pythonpath: str | None = None,
         cache: Path | None = None) -> dict[str, str]:  # fmt: skip
    env = dict(os.environ)
    env["BATCHMLX_CACHE_DIR"] = str(cache or CACHE)
    env.pop("BATCHMLX_BLAS_REEXEC", None)  # each process chooses its BLAS itself, as a user's
    env.pop("LD_PRELOAD", None)
    if home is not None:
        env["BATCHMLX_HOME"] = home
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


def run_batchmlx(data: bytes, label: str, source: Path | None = None) -> ProcessRun:
    """`batchmlx submit --wait` then `batchmlx results`, from `source` (a checkout) or this one."""
    work = Path(tempfile.mkdtemp(prefix="bmx-proc-"))
    (work / "requests.jsonl").write_bytes(data)
    env = _env(home=str(work / "home"), pythonpath=str(source or REPO))
    cli = [sys.executable, "-c", "from batchmlx.cli import main; main()"]
    t0 = time.perf_counter()
    out = subprocess.run([*cli, "submit", "requests.jsonl", "--wait", "--json"], cwd=work,
                         env=env, capture_output=True, text=True)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{label}: submit failed ({out.returncode}): {out.stderr[-2000:]}")
    batch = json.loads(out.stdout[out.stdout.index("{") :])
    subprocess.run([*cli, "results", batch["id"], "-o", "out.jsonl"], cwd=work, env=env,
                   check=True, capture_output=True)  # fmt: skip
    wall = time.perf_counter() - t0
    texts, tokens = read_output(work / "out.jsonl")
    return ProcessRun(label, wall, texts, tokens, {"batch": batch.get("usage")})


def read_output(path: Path) -> tuple[dict[str, str], int]:
    """A chat batch's output file: its texts by custom_id and its completion tokens."""
    texts, tokens = {}, 0
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        body = rec["response"]["body"]
        texts[rec["custom_id"]] = body["choices"][0]["message"]["content"]
        tokens += body["usage"]["completion_tokens"]
    return texts, tokens


def run_peer(data: bytes, label: str = "mlx_lm.batch_generate") -> ProcessRun:
    """This module's --peer mode in a fresh process."""
    work = Path(tempfile.mkdtemp(prefix="bmx-peer-"))
    (work / "requests.jsonl").write_bytes(data)
    cmd = [sys.executable, "-m", "benchmarks.whole_process", "--peer",
           str(work / "requests.jsonl"), "--peer-out", str(work / "out.json")]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, env=_env(pythonpath=str(REPO)), check=True)
    wall = time.perf_counter() - t0
    res = json.loads((work / "out.json").read_text())
    return ProcessRun(label, wall, res["texts"], res["output_tokens"])


def peer_main(path: str, out: str) -> None:
    """mlx_lm.batch_generate as a user runs it, on the float32 weights batchmlx runs."""
    from batchmlx.engine.host.fast_blas import ensure_fast_blas

    ensure_fast_blas()  # the same BLAS batchmlx re-executes onto
    import mlx.core as mx
    import mlx_lm

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import dequantize_model, model_folder

    folder = model_folder(resolve_model("default", cache_dir=CACHE), cache_dir=CACHE)
    model, tok = mlx_lm.load(str(folder))
    dequantize_model(model, mx.float32)
    ids, prompts, max_tokens = [], [], 0
    for line in Path(path).read_bytes().splitlines():
        rec = orjson.loads(line)
        enc = tok.apply_chat_template(rec["body"]["messages"], add_generation_prompt=True,
                                      tokenize=True)  # fmt: skip
        prompts.append(list(enc["input_ids"] if hasattr(enc, "keys") else enc))
        ids.append(rec["custom_id"])
        max_tokens = rec["body"]["max_tokens"]
    resp = mlx_lm.batch_generate(model, tok, prompts, max_tokens=max_tokens,
                                 return_token_ids=True)  # fmt: skip
    texts = dict(zip(ids, resp.texts, strict=True))
    n = sum(len(t) for t in resp.token_ids)
    Path(out).write_text(json.dumps({"texts": texts, "output_tokens": n}))


def export_rev(rev: str) -> Path:
    """An earlier commit's tree in a temp folder (its batchmlx runs from there)."""
    dest = Path(tempfile.mkdtemp(prefix="bmx-rev-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def compile_sources(tree: Path) -> None:
    """Byte-compile a checkout's batchmlx package, as pip does when it installs one: a process
    timed from a tree without bytecode would compile ~15,000 lines first (~0.15 s a process
    here, where PYTHONDONTWRITEBYTECODE keeps Python from writing .pyc files itself)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "batchmlx")],
                   check=True)  # fmt: skip


def same_texts(a: ProcessRun, b: ProcessRun) -> str:
    same = sum(1 for k, v in a.texts.items() if b.texts.get(k) == v)
    return f"{same}/{len(a.texts)}"


WORKLOADS = {
    "unique": Workload("unique", 64, 128, None),
    "shared": Workload("shared", 64, 32, 900),
}
QUICK = {
    "unique": Workload("unique", 8, 16, None),
    "shared": Workload("shared", 8, 8, 300),
}


def measure(
    *,
    quick: bool = False,
    baseline: str | None = None,
    peer_shared: bool = False,
    only: tuple[str, ...] = (),
    peer: bool = True,
    repeats: int = 2,
) -> dict[Workload, list[ProcessRun]]:
    """Each system's runs of a workload, `repeats` rounds with the systems interleaved (so a
    slow spell of the machine hits every system alike); each row keeps its best wall."""
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import model_folder

    folder = model_folder(resolve_model("default", cache_dir=CACHE), cache_dir=CACHE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    base_src = export_rev(baseline) if baseline else None
    for tree in (REPO, base_src):
        if tree is not None:
            compile_sources(tree)
    runs: dict[Workload, list[ProcessRun]] = {}
    for name, wl in (QUICK if quick else WORKLOADS).items():
        if only and name not in only:
            continue
        data = wl.batch_file(tok)
        rows: list[ProcessRun] = []
        for round_ in range(1 if quick else repeats):
            got = []
            log(f"{name}: batchmlx ({wl.requests} x {wl.max_tokens}), round {round_ + 1}")
            got.append(run_batchmlx(data, "batchmlx (defaults)"))
            if base_src is not None:
                log(f"{name}: batchmlx at {baseline}")
                got.append(run_batchmlx(data, f"batchmlx at {baseline} (defaults)", base_src))
            if peer and (name == "unique" or peer_shared):
                log(f"{name}: mlx_lm.batch_generate float32")
                got.append(run_peer(data))
            if not rows:
                rows = got
            else:
                for row, again in zip(rows, got, strict=True):
                    row.merge(again)
        runs[wl] = rows
    return runs


def section(runs: dict[Workload, list[ProcessRun]]) -> list[str]:
    lines = [
        "Each system is a fresh process timed from spawn to results in hand (model load "
        "included): batchmlx `submit --wait` + `results -o`; the peer a script that loads the "
        "same float32 weights and calls `mlx_lm.batch_generate` with its defaults. Greedy, "
        "stopping at eos on every side; tok/s = completion tokens / wall. The systems run in "
        "turn, round after round; a row's wall is its best round (every round listed).",
        "",
    ]
    for wl, rows in runs.items():
        what = f"{wl.requests} requests x up to {wl.max_tokens} new tokens" + (
            f", one ~{wl.system_tokens}-token system prompt" if wl.system_tokens
            else ", different questions"
        )  # fmt: skip
        ref = rows[0]
        lines += [f"**{wl.name}** ({what})", "",
                  "| System | wall s | rounds s | completion tokens | tok/s | batchmlx / this | "
                  "same texts as batchmlx |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            rounds = ", ".join(f"{w:.1f}" for w in (r.walls or [r.wall_s]))
            unstable = f" ({r.unstable} changed between rounds)" if r.unstable else ""
            lines.append(
                f"| {r.system} | {r.wall_s:.1f} | {rounds} | {r.output_tokens} | "
                f"{r.tok_s:.1f} | **{ref.tok_s / r.tok_s if r.tok_s else 0:.2f}x** | "
                f"{same_texts(ref, r)}{unstable} |"
            )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--baseline", help="also run batchmlx from this git revision")
    p.add_argument(
        "--peer-shared",
        action="store_true",
        help="also run batch_generate on the shared workload (about 10 minutes)",
    )
    p.add_argument(
        "--workload",
        action="append",
        choices=sorted(WORKLOADS),
        default=[],
        help="run only this workload (repeatable; default: all)",
    )
    p.add_argument("--no-peer", action="store_true", help="batchmlx rows only")
    p.add_argument("--out", default="benchmarks/RESULTS-process.md")
    p.add_argument("--peer", help=argparse.SUPPRESS)
    p.add_argument("--peer-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        peer_main(args.peer, args.peer_out)
        return 0
    runs = measure(quick=args.quick, baseline=args.baseline, peer_shared=args.peer_shared,
                   only=tuple(args.workload), peer=not args.no_peer)  # fmt: skip
    lines = ["# Whole-process throughput", "",
             f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
             *section(runs)]  # fmt: skip
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
