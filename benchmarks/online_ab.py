"""Online streams over a batch, A/B over serve's engine options, in one run (issue 49).

    python -m benchmarks.online_ab [--rounds 3] [--batch 256] [--streams 8] RUN [RUN ...]

Each RUN is a fresh `batchmlx serve` (the default model, a fresh $BATCHMLX_HOME): `alone` (the
streams, no batch), or `name=OPTIONS` with serve's options after the `=`, e.g.
`before=--batch-decodes-beside-online=256 after=--batch-decodes-beside-online=16`; with a batch
(`--batch` chats of 32 tokens through the Files and Batches APIs, started 2 s before the
streams). `name@TREE=OPTIONS` (or `alone@TREE`) runs the server from another checkout (TREE
first on PYTHONPATH), e.g. `main@../main= this=` for a change against main in one run.
`--streams` (8) streamed chats x `--rounds` of 32 tokens, as `benchmarks.peers.online` sends
them, each stream's next request at once or `--think-s` after its last answer (so that it comes
while the batch runs alone, as a user's would); `--streams 0`: the batch alone, its time from
creation to completion (what an option costs it with no online work).
Prints one line per run: TTFT and inter-token p50/p99, the batch lines finished while the
streams ran, and the load average before and after. Alternate the runs (a b a b) on a shared
machine: its load moves between them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.load_plan import HOST, _pct
from benchmarks.load_serve import Server, _free_port, httpx
from benchmarks.peers import online as peers

STREAMS = 8  # the default


def _start(home: Path, options: list[str], tree: str) -> Server:
    port = _free_port()
    env = dict(os.environ, BATCHMLX_HOME=str(home))
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    env.setdefault("BATCHMLX_CACHE_DIR", str(Path.home() / ".cache" / "batchmlx-test"))
    env.pop("BATCHMLX_API_KEY", None)  # the harness sends no key
    log = home / "server.log"
    with log.open("wb") as out:
        # `-m` puts the working directory first on sys.path, ahead of PYTHONPATH: run from a
        # checkout, its batchmlx would serve every run, whatever TREE says
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchmlx.cli", "serve", "--host", HOST, "--port", str(port),
             *options],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tree or None,
        )  # fmt: skip
    return Server(proc, f"http://{HOST}:{port}", log)


def _done(progress: str) -> int:
    return int(progress.split("/")[0])


def _ms(xs: list[float], q: float) -> str:
    return f"{1000 * _pct(xs, q):.0f}"


async def run(
    name: str, options: list[str], setup: peers.Setup, underneath: bool, tree: str = ""
) -> str:
    (streams,) = setup.streams
    with tempfile.TemporaryDirectory(prefix="online-ab-") as tmp:
        server = _start(Path(tmp), options, tree)
        try:
            await peers._ready(server, setup)
            limits = httpx.Limits(max_connections=setup.batch + 16)
            async with httpx.AsyncClient(base_url=server.base, timeout=60, limits=limits) as c:
                row = peers.Row("batchmlx", streams, underneath)
                batch = None
                if underneath:
                    batch = peers.BmxBatch(c, server, setup)
                    await batch.start()
                    await asyncio.sleep(setup.settle_s)
                    before = _done(await batch.progress())
                load0, t = os.getloadavg()[0], time.perf_counter()
                if batch is not None and streams == 0:  # the batch's own time, nothing beside
                    done = await batch.finish()
                    load1 = os.getloadavg()[0]
                    return f"{name}: the batch alone {done}; load {load0:.2f} -> {load1:.2f}"
                await peers.streams(server.base, streams, setup, row, 1000)
                wall = time.perf_counter() - t
                note = ""
                if batch is not None:
                    lines = _done(await batch.progress()) - before
                    note = f"; batch lines done meanwhile {lines} ({lines / wall:.2f}/s)"
        finally:
            server.stop()
    return (
        f"{name}: TTFT p50/p99 {_ms(row.ttft, 50)}/{_ms(row.ttft, 99)} ms, inter-token p50/p99 "
        f"{_ms(row.itl, 50)}/{_ms(row.itl, 99)} ms, {row.requests} requests in {wall:.1f} s"
        f"{note}; {len(row.failures)} failures; load {load0:.2f} -> {os.getloadavg()[0]:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="alone, or name=serve options (see the module doc)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--streams", type=int, default=STREAMS)
    ap.add_argument("--think-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    setup = replace(peers.Setup(), streams=(args.streams,), rounds=args.rounds, batch=args.batch,
                    think_s=args.think_s)  # fmt: skip
    for spec in args.runs:
        label, _, options = spec.partition("=")
        name, _, tree = label.partition("@")
        tree = str(Path(tree).resolve()) if tree else ""
        line = asyncio.run(run(label, options.split(), setup, name != "alone", tree))
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
