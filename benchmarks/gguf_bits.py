"""A GGUF file's first and warm start, before and after a change, side by side:

    python -m benchmarks.gguf_bits FILE.gguf [...] --before CHECKOUT [--dtype auto] [--rounds 3]

For each file, `--rounds` times, each checkout (`--before`, then this one), in a fresh model cache:
`batchmlx submit --model FILE --wait` of a few short chats twice, as fresh processes under
/usr/bin/time: the first start converts the file and packs the host weights, the second reads
both back. Reports the converted folder's size on disk, each run's wall time and peak RSS (the
whole process, time's maximum resident set size), and the machine's CPU and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Say hello.", "Name a color.", "Count to three.", "What is 2+2?"]


@dataclass
class Start:
    """One `submit --wait` process."""

    wall_s: float
    peak_mb: float


@dataclass
class Row:
    file: str
    label: str
    folder_mb: float
    first: Start
    warm: Start


def _du_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) / 1e6


def _submit(source: Path, model: Path, cache: Path, dtype: str, max_tokens: int) -> Start:
    work = Path(tempfile.mkdtemp(prefix="gguf-bits-"))
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "x", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": p}]}}
             for i, p in enumerate(PROMPTS)]  # fmt: skip
    (work / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    env = {**os.environ, "PYTHONPATH": str(source), "BATCHMLX_HOME": str(work / "home"),
           "BATCHMLX_CACHE_DIR": str(cache)}  # fmt: skip
    cli = [sys.executable, "-c", "from batchmlx.cli import main; main()"]
    cmd = ["/usr/bin/time", "-v", *cli, "submit", "in.jsonl", "--model", str(model),
           "--dtype", dtype, "--wait"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"submit failed ({out.returncode}): {out.stderr[-3000:]}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr)
    assert peak is not None, out.stderr[-2000:]
    return Start(wall, int(peak.group(1)) / 1024)


def _machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), "?")  # fmt: skip
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs ({cpu}), load average (1/5/15 min) {load}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare with")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs per file")
    args = ap.parse_args(argv)
    print(f"at start: {_machine()}", flush=True)
    rows = []
    runs = [(model, label, source) for model in args.files for _ in range(args.rounds)
            for label, source in (("before", args.before), ("after", REPO))]  # fmt: skip
    for model, label, source in runs:
        cache = Path(tempfile.mkdtemp(prefix="gguf-bits-cache-"))
        try:
            first = _submit(source, model.resolve(), cache, args.dtype, args.max_tokens)
            warm = _submit(source, model.resolve(), cache, args.dtype, args.max_tokens)
            rows.append(Row(model.name, label, _du_mb(cache / "models"), first, warm))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        r = rows[-1]
        print(f"{r.file} {label}: folder {r.folder_mb:.0f} MB, first {r.first.wall_s:.1f} s "
              f"{r.first.peak_mb:.0f} MB, warm {r.warm.wall_s:.1f} s {r.warm.peak_mb:.0f} MB",
              flush=True)  # fmt: skip
    print(f"at end: {_machine()}\n")
    print("| file | checkout | folder on disk | first start | first peak RSS | warm start | "
          "warm peak RSS |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(
            f"| {r.file} | {r.label} | {r.folder_mb:,.0f} MB | {r.first.wall_s:.1f} s | "
            f"{r.first.peak_mb:,.0f} MB | {r.warm.wall_s:.1f} s | {r.warm.peak_mb:,.0f} MB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
