"""The CLI's failure paths, end to end and fast: nothing here loads the model."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai.types import Batch

from tests.e2e.helpers import (
    COMPLETIONS_URL,
    Cli,
    chat_body,
    describe,
    read_jsonl,
    request_line,
    write_jsonl,
)

WORKER_IDLE_S = 30  # `worker --until-idle` on an empty queue: interpreter start-up and one poll


def assert_worker_exits_without_work(cli: Cli) -> None:
    """Nothing is queued: the worker finds no work and exits without loading a model."""
    t0 = time.monotonic()
    proc = cli("worker", "--until-idle", timeout=WORKER_IDLE_S)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, describe(proc)
    assert elapsed < WORKER_IDLE_S
    assert "SmolLM2" not in proc.stdout + proc.stderr


def invalid_file(path: Path) -> Path:
    return write_jsonl(
        path,
        [
            request_line("a", chat_body("hi", max_tokens=4)),
            '{"custom_id": "b", "method": "POST", "url": ',  # line 2: broken JSON
            request_line("a", chat_body("again", max_tokens=4)),  # line 3: duplicate id
            request_line("c", {"model": "gpt-4o-mini", "prompt": "x"}, url=COMPLETIONS_URL),
            "",  # line 5: blank lines are fine (and still counted)
            request_line("d", chat_body("fine", max_tokens=4)),
        ],
    )


def test_invalid_file_fails_whole_with_every_error(cli: Cli, tmp_path: Path) -> None:
    path = invalid_file(tmp_path / "bad.jsonl")
    proc = cli("submit", path, "--model", "default", "--json")
    assert proc.returncode == 1, describe(proc)
    obj = json.loads(proc.stdout)
    batch = Batch.model_validate(obj)
    assert batch.status == "failed"
    assert batch.failed_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None
    assert batch.errors is not None and batch.errors.data is not None
    got = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert got == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "invalid_url", "url"),
    ]
    for e in batch.errors.data[:2]:
        assert e.message and f"Line {e.line}" in e.message
    # OpenAI's words, which name no line: the error's `line` does
    assert batch.errors.data[2].message == (
        "The URL provided for this request does not match the batch endpoint."
    )
    assert obj["request_counts"] == {"total": 0, "completed": 0, "failed": 0}

    # the human form lists them too, with line numbers
    human = cli("submit", path, "--model", "default")
    assert human.returncode == 1, describe(human)
    for n in (2, 3, 4):
        assert f"line {n}:" in human.stdout
    assert "validation failed with 3 error(s)" in human.stdout

    # --wait does not wait for a file that failed
    waited = cli("submit", path, "--model", "default", "--wait", "--json", timeout=60)
    assert waited.returncode == 1, describe(waited)
    assert json.loads(waited.stdout)["status"] == "failed"

    # all three are recorded as failed batches; none left anything to run
    listed = cli.json("list")
    assert len(listed) == 3
    assert {b["status"] for b in listed} == {"failed"}
    assert_worker_exits_without_work(cli)
    assert {b["status"] for b in cli.json("list")} == {"failed"}


def test_cancel_of_a_failed_batch_is_an_error(cli: Cli, tmp_path: Path) -> None:
    path = invalid_file(tmp_path / "bad.jsonl")
    batch_id = cli.json("submit", path, ok=False)["id"]
    proc = cli("cancel", batch_id)
    assert proc.returncode != 0, describe(proc)
    assert "Cannot cancel a batch with status 'failed'." in proc.stderr
    assert cli.json("status", batch_id)["status"] == "failed"


def test_unknown_body_model_under_strict_models_fails_with_model_not_found(
    cli: Cli, tmp_path: Path
) -> None:
    path = write_jsonl(
        tmp_path / "openai.jsonl",
        [request_line(f"r{i}", chat_body("hi", max_tokens=4)) for i in range(3)],
    )
    # without --strict-models the default model serves it (tests/e2e/test_model_names.py)
    proc = cli("submit", path, "--json", "--strict-models")
    assert proc.returncode == 1, describe(proc)
    batch = Batch.model_validate_json(proc.stdout)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data is not None
    codes = [e.code for e in batch.errors.data]
    assert codes == ["model_not_found"]
    err = batch.errors.data[0]
    assert err.param == "body.model" and err.line == 1
    assert "gpt-4o-mini" in (err.message or "")
    assert_worker_exits_without_work(cli)


def test_unresolvable_model_option_is_refused(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", "no such model")
    assert proc.returncode != 0, describe(proc)
    assert "cannot be resolved" in proc.stderr
    assert cli.json("list") == []


@pytest.mark.parametrize("command", ["worker", "serve"])
def test_a_model_option_naming_a_file_it_cannot_serve_stops_at_start(
    cli: Cli, tmp_path: Path, command: str
) -> None:
    """The submit-time check, at a worker's or server's start: not a traceback per line later."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # a header that ends at its version
    with socket.socket() as s:  # a free port: the model is refused before it would listen
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    extra = ("--until-idle",) if command == "worker" else ("--port", port)
    proc = cli(command, "--model", bad, *extra, timeout=WORKER_IDLE_S)
    assert proc.returncode == 1, describe(proc)
    assert proc.stderr.strip().splitlines() == [
        f"error: --model: model '{bad}' cannot be resolved: The GGUF file 'broken.gguf' cannot be "
        "served: it cannot be read as GGUF: the header ends early (a truncated file?)."
    ]


def test_bad_completion_window_is_refused(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", "default", "--completion-window", "soon")
    assert proc.returncode != 0, describe(proc)
    assert "completion window" in proc.stderr
    assert cli.json("list") == []


def test_missing_input_file(cli: Cli, tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    proc = cli("submit", missing, "--model", "default")
    assert proc.returncode != 0, describe(proc)
    assert "no such file" in proc.stderr and str(missing) in proc.stderr
    assert proc.stdout == ""


def test_empty_file_fails(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    proc = cli("submit", path, "--model", "default", "--json")
    assert proc.returncode == 1, describe(proc)
    obj = json.loads(proc.stdout)
    assert obj["status"] == "failed"
    assert [e["code"] for e in obj["errors"]["data"]] == ["empty_file"]
    # no line names an endpoint: the default one, never ""; --endpoint names it
    assert obj["endpoint"] == "/v1/chat/completions"
    proc = cli("submit", path, "--model", "default", "--endpoint", "/v1/embeddings", "--json")
    assert proc.returncode == 1, describe(proc)
    assert json.loads(proc.stdout)["endpoint"] == "/v1/embeddings"


def test_streaming_line_fails_the_file(cli: Cli, tmp_path: Path) -> None:
    """As over HTTP (tests/server/test_fidelity.py): OpenAI's streaming_unsupported."""
    path = write_jsonl(tmp_path / "stream.jsonl", [
        request_line("a", chat_body("hi", max_tokens=4)),
        request_line("b", chat_body("hi", max_tokens=4, stream=True)),
    ])  # fmt: skip
    proc = cli("submit", path, "--model", "default", "--json")
    assert proc.returncode == 1, describe(proc)
    errors = json.loads(proc.stdout)["errors"]["data"]
    assert errors == [{
        "code": "streaming_unsupported", "line": 2, "param": "body.stream",
        "message": "Chat Completions: Streaming is not supported in the Batch API.",
    }]  # fmt: skip


def test_endpoint_option(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", "default", "--endpoint", "/v1/completions", "--json")
    assert proc.returncode == 1, describe(proc)
    errors = json.loads(proc.stdout)["errors"]["data"]
    assert [(e["code"], e["line"], e["param"]) for e in errors] == [("invalid_url", 1, "url")]
    proc = cli("submit", path, "--model", "default", "--endpoint", "/v1/nope")
    assert proc.returncode != 0, describe(proc)
    assert "Invalid value: '/v1/nope'. Supported values are:" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("status", "batch_doesnotexist"),
        ("status", "batch_doesnotexist", "--json"),
        ("results", "batch_doesnotexist"),
        ("results", "batch_doesnotexist", "--errors"),
        ("cancel", "batch_doesnotexist"),
    ],
    ids=lambda a: " ".join(a),
)
def test_unknown_batch_id(cli: Cli, args: tuple[str, ...]) -> None:
    proc = cli(*args)
    assert proc.returncode != 0, describe(proc)
    assert "no batch with id 'batch_doesnotexist'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_cancel_without_a_worker_settles_at_once(cli: Cli, tmp_path: Path) -> None:
    ids = ["x1", "x2", "x3"]
    path = write_jsonl(
        tmp_path / "three.jsonl", [request_line(i, chat_body("hi", max_tokens=4)) for i in ids]
    )
    submitted = cli.json("submit", path, "--model", "default")
    batch = Batch.model_validate(submitted)
    assert batch.status == "in_progress"
    assert batch.request_counts is not None and batch.request_counts.total == 3

    # results of an unfinished batch: a clear error, not an empty file
    early = cli("results", batch.id)
    assert early.returncode != 0, describe(early)
    assert "in_progress" in early.stderr and "not finished" in early.stderr

    cancelled = Batch.model_validate(cli.json("cancel", batch.id))
    assert cancelled.status == "cancelled"
    assert cancelled.cancelling_at is not None and cancelled.cancelled_at is not None
    assert cancelled.output_file_id is None
    assert cancelled.error_file_id is not None
    assert cancelled.request_counts is not None
    assert cancelled.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}

    err_path = tmp_path / "err.jsonl"
    proc = cli("results", batch.id, "--errors", "-o", err_path)
    assert proc.returncode == 0, describe(proc)
    lines = read_jsonl(err_path)
    assert sorted(ln["custom_id"] for ln in lines) == ids
    for ln in lines:
        assert ln["id"].startswith("batch_req_")
        assert ln["response"] is None
        assert ln["error"]["code"] == "batch_cancelled"
        assert ln["error"]["message"]
    # no output file: `results` writes nothing, says so and exits 3 (test_everyday.py)
    out = cli("results", batch.id)
    assert out.returncode == 3, describe(out)
    assert out.stdout == "" and "has no output file" in out.stderr

    # cancelling again is harmless; the status stays cancelled
    again = cli("cancel", batch.id, "--json")
    assert again.returncode == 0, describe(again)
    assert json.loads(again.stdout)["status"] == "cancelled"
    assert cli.json("status", batch.id)["status"] == "cancelled"
    assert_worker_exits_without_work(cli)
    # the worker did not redo the cancelled batch's files
    assert cli.json("status", batch.id) == json.loads(again.stdout)


def test_console_script_runs(cli: Cli) -> None:
    exe = shutil.which("batchmlx")
    if exe is None:
        pytest.skip("the batchmlx console script is not on PATH")
    proc = subprocess.run(
        [exe, "list", "--json"], env=cli.env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    usage = subprocess.run([exe], env=cli.env, capture_output=True, text=True, timeout=120)
    assert "submit" in usage.stdout + usage.stderr


def test_metadata_is_kept_on_the_batch(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    obj = cli.json(
        "submit", path, "--model", "default", "--metadata", "team=e2e", "--metadata", "eq=a=b"
    )
    assert obj["metadata"] == {"team": "e2e", "eq": "a=b"}
    assert cli.json("status", obj["id"])["metadata"] == obj["metadata"]


def test_malformed_metadata_is_a_clear_error(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    proc = cli("submit", path, "--model", "default", "--metadata", "novalue")
    assert proc.returncode != 0, describe(proc)
    assert "Traceback" not in proc.stderr and "ValueError" not in proc.stderr
    assert "metadata" in proc.stderr
    assert cli.json("list") == []


def test_submit_priority_is_kept_as_metadata_and_bounded(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    obj = cli.json("submit", path, "--model", "default", "--priority", "-4")
    assert obj["metadata"] == {"priority": "-4"}
    proc = cli("submit", path, "--model", "default", "--priority", "500")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, describe(proc)
    proc = cli("submit", path, "--model", "default", "--metadata", "priority=x")
    assert proc.returncode != 0 and "metadata.priority" in proc.stderr, describe(proc)
    assert len(cli.json("list")) == 1


def test_output_expires_after_out_of_bounds_is_refused(cli: Cli, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "ok.jsonl", [request_line("a", chat_body("hi", max_tokens=4))])
    proc = cli("submit", path, "--output-expires-after", "60")
    assert proc.returncode != 0
    assert "between 3600 and 2592000" in proc.stdout + proc.stderr, describe(proc)
    assert cli("list").stdout.strip() == "no batches"  # nothing was enqueued


# -- one clean line for every error, and never a password (issue 21) ------------------------

PASSWORD = "S3cretPw!"


def one_error_line(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The command failed with `code` and said why in one line, with no traceback nor
    password; that line."""
    assert proc.returncode == code, describe(proc)
    assert "Traceback" not in proc.stderr + proc.stdout, describe(proc)
    assert PASSWORD not in proc.stderr + proc.stdout, describe(proc)
    errors = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: "), describe(proc)
    return errors[0]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"postgresql+pg9000://bmx:{PASSWORD}@127.0.0.1/db", "unsupported PostgreSQL driver"),
        (f"mysql://bmx:{PASSWORD}@127.0.0.1/db", "unsupported database URL"),
        (f"postgresql://bmx:{PASSWORD}@127.0.0.1:port/db", "cannot parse the database URL"),
        (f"postgresql://bmx:{PASSWORD}@127.0.0.1:1/db", "cannot open the database"),
    ],
    ids=["unknown driver", "mysql", "unparseable", "unreachable"],
)
@pytest.mark.parametrize("args", [("status",), ("watch", "inbox"), ("purge", "--older-than", "1")],
                         ids=lambda a: a[0])  # fmt: skip
def test_a_bad_database_url_is_one_line_without_its_password(
    cli: Cli, url: str, says: str, args: tuple[str, ...]
) -> None:
    line = one_error_line(cli("--database-url", url, *args, timeout=120))
    assert says in line and "bmx:***@" in line, line


def test_a_busy_port_is_one_line(cli: Cli) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        line = one_error_line(cli("worker", "--until-idle", "--metrics-port", port, timeout=120))
        assert f"cannot listen on 127.0.0.1:{port} (--metrics-port)" in line
        assert "in use" in line
        line = one_error_line(cli("serve", "--no-worker", "--port", port, timeout=120))
        assert f"cannot listen on 127.0.0.1:{port} (--port)" in line


def test_serve_on_an_unreachable_database_is_one_line(cli: Cli) -> None:
    url = f"postgresql://bmx:{PASSWORD}@127.0.0.1:1/db"
    with socket.socket() as probe:  # a port free now (the serve fails before binding it)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    line = one_error_line(cli("--database-url", url, "serve", "--no-worker", "--port", port,
                              timeout=120))  # fmt: skip
    assert "cannot open the database postgresql+asyncpg://bmx:***@127.0.0.1:1/db" in line


@pytest.mark.parametrize(
    "args",
    [("list", "--limit", "x"), ("list", "--limit", "0"), ("nosuch",), ("submit",),
     ("purge", "--older-than", "-1"), ("worker", "--max-attempts", "0")],
    ids=lambda a: " ".join(a),
)  # fmt: skip
def test_a_bad_flag_value_is_one_line(cli: Cli, args: tuple[str, ...]) -> None:
    line = one_error_line(cli(*args, timeout=120), code=2)
    assert "--help" in line  # where to look


def test_a_home_that_cannot_be_made_is_one_line(cli: Cli, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = cli.env | {"BATCHMLX_HOME": str(blocker / "home")}
    proc = subprocess.run([sys.executable, "-m", "batchmlx.cli", "list"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert str(blocker) in one_error_line(proc)
    bad = cli.env | {"BATCHMLX_RETENTION_DAYS": "soon"}
    proc = subprocess.run([sys.executable, "-m", "batchmlx.cli", "list"], env=bad,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "$BATCHMLX_RETENTION_DAYS" in one_error_line(proc)


def test_purge_removes_finished_batches_and_says_what(cli: Cli, tmp_path: Path) -> None:
    failed = cli.json("submit", invalid_file(tmp_path / "bad.jsonl"), ok=False)["id"]
    path = write_jsonl(tmp_path / "one.jsonl", [request_line("r", chat_body("hi"))])
    queued = cli.json("submit", path, "--model", "default")["id"]
    # finished just now: not older than a day
    assert cli("purge", "--older-than", "1").stdout.startswith("purged 0 batches")
    dry = cli("purge", "--older-than", "0", "--dry-run")
    assert dry.returncode == 0 and f"would purge {failed}" in dry.stdout, describe(dry)
    assert cli.json("status", failed)["status"] == "failed"
    gone = cli("purge", "--older-than", "0")
    assert gone.returncode == 0, describe(gone)
    assert f"purged {failed}  failed" in gone.stdout and queued not in gone.stdout
    assert "purged 1 batch finished over 0 days ago" in gone.stdout
    assert [b["id"] for b in cli.json("list")] == [queued]  # the unfinished one stays
    assert "no batch with id" in one_error_line(cli("status", failed))
