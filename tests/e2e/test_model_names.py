"""One model rule on every path, end to end (docs/models.md): a file written for OpenAI
(`"model": "gpt-4o-mini"`) gives the same result through `batchmlx submit`, the inbox (`watch`)
and the HTTP API (`serve`); `--strict-models` refuses it as OpenAI refuses a model its Batch API
cannot serve; `--model-alias` sends it to a model; a hub id that cannot be fetched fails
validation. The engine runs the tiny random-weight model."""

from __future__ import annotations

import io
import json
import socket
import subprocess
from pathlib import Path

from openai import NotFoundError

from tests.e2e.helpers import (
    Cli,
    chat_body,
    describe,
    make_cli,
    request_line,
    watch_once,
    write_jsonl,
)  # fmt: skip
from tests.server.helpers import start_server, wait_validated

OPENAI_SENTENCE = "The provided model 'gpt-4o-mini' is not supported by the Batch API."


def openai_file(path: Path, model: str = "gpt-4o-mini") -> Path:
    return write_jsonl(path, [
        request_line(f"r{i}", chat_body(f"Question {i}?", model=model, max_tokens=4,
                                        temperature=0))
        for i in range(2)
    ])  # fmt: skip


def _validated_over_http(client, path: Path):
    """Upload `path`, create its batch as an OpenAI client does, and wait for validation."""
    f = client.files.create(file=(path.name, io.BytesIO(path.read_bytes())), purpose="batch")
    created = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")  # fmt: skip
    return wait_validated(client, created.id)


def _answers(cli: Cli, batch_id: str) -> dict[str, tuple[str, str]]:
    """custom_id -> (the body's model, the answer) of a batch's output file."""
    proc = cli("results", batch_id)
    assert proc.returncode == 0, describe(proc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {
        r["custom_id"]: (r["response"]["body"]["model"],
                         r["response"]["body"]["choices"][0]["message"]["content"])
        for r in rows
    }  # fmt: skip


def test_an_openai_file_gives_the_same_result_on_every_path(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cli = make_cli(tmp_path)
    path = openai_file(tmp_path / "openai.jsonl")
    # the inbox first: it would take a later drop of this content (and model) for a duplicate
    watch_once(cli, tmp_path / "inbox", path, tmp_path / "watch.log")
    via_cli = cli.json("submit", path)
    server = start_server(tmp_path, "--no-worker")  # the same home, so the same queue
    try:
        via_http = _validated_over_http(server.client(), path)
    finally:
        server.stop()
    batches = cli.json("list")
    assert len(batches) == 3
    # every path chose the same model for the OpenAI name: the default
    assert {(b["status"], b["model"]) for b in batches} == {("in_progress", "default")}
    assert via_cli["model"] == via_http.model == "default"

    # a worker of another model runs them all; the Batch and its bodies name what answered
    tiny = str(tiny_model_dir)
    worker = cli("worker", "--until-idle", "--model", tiny, timeout=300)
    assert worker.returncode == 0, describe(worker)
    answers = []
    for b in cli.json("list"):
        assert (b["status"], b["model"]) == ("completed", tiny), b
        answers.append(_answers(cli, b["id"]))
    assert answers[0] == answers[1] == answers[2]
    assert {model for model, _ in answers[0].values()} == {tiny}


def test_an_alias_sends_the_openai_name_to_its_model(tmp_path: Path, tiny_model_dir: Path):
    cli = make_cli(tmp_path)
    path = openai_file(tmp_path / "openai.jsonl")
    tiny = str(tiny_model_dir)
    proc = cli("submit", path, "--model-alias", f"gpt-4o-mini={tiny}", "--wait", "--json",
               timeout=300)  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert (batch["status"], batch["model"]) == ("completed", tiny)
    assert {m for m, _ in _answers(cli, batch["id"]).values()} == {tiny}
    bad = cli("submit", path, "--model-alias", "gpt-4o-mini")
    assert bad.returncode == 1 and "--model-alias expects NAME=MODEL" in bad.stderr, describe(bad)


def test_strict_models_refuses_as_openai_on_every_path(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    path = openai_file(tmp_path / "openai.jsonl")
    flag = cli("submit", path, "--strict-models", "--json")
    env = subprocess.run(
        [*_cli_argv(), "submit", str(path), "--json"], capture_output=True, text=True,
        env={**cli.env, "BATCHMLX_STRICT_MODELS": "1"}, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    for proc in (flag, env):
        assert proc.returncode == 1, describe(proc)
        batch = json.loads(proc.stdout)
        assert batch["status"] == "failed"
        [err] = batch["errors"]["data"]
        assert (err["code"], err["line"], err["param"]) == ("model_not_found", 1, "body.model")
        assert err["message"].startswith(OPENAI_SENTENCE + " Use 'default' (SmolLM2-135M-Instruct)")
    human = cli("submit", path, "--strict-models")
    assert "--model-alias" in human.stdout, describe(human)  # the hint reaches the user

    server = start_server(tmp_path / "srv", "--no-worker", "--strict-models")
    try:
        client = server.client()
        b = _validated_over_http(client, path)
        assert b.status == "failed" and b.errors is not None and b.errors.data is not None
        [err] = b.errors.data
        assert (err.code, err.line, err.param) == ("model_not_found", 1, "body.model")
        assert err.message is not None and err.message.startswith(
            OPENAI_SENTENCE + " This server serves 'default' (SmolLM2-135M-Instruct)"
        )
        # online: OpenAI's 404 for a model that does not exist, before any worker is needed
        try:
            client.chat.completions.create(
                model="gpt-4o-mini", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
            )
            raise AssertionError("not refused")
        except NotFoundError as exc:
            assert exc.status_code == 404
            body = exc.body if isinstance(exc.body, dict) else {}
            assert body.get("code") == "model_not_found" and body.get("param") is None
            assert body["message"].startswith(
                "The model `gpt-4o-mini` does not exist or you do not have access to it."
            )
    finally:
        server.stop()


def test_a_hub_id_that_cannot_be_fetched_fails_validation(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    name = "batchmlx-tests/never-downloaded"
    path = openai_file(tmp_path / "hub.jsonl", model=name)
    with socket.socket() as s:  # a port nothing listens on: the hub "cannot be reached"
        s.bind(("127.0.0.1", 0))
        hub = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in cli.env.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run(
        [*_cli_argv(), "submit", str(path), "--json"], capture_output=True, text=True,
        env={**env, "HF_ENDPOINT": hub, "HF_HOME": str(tmp_path / "hf")}, cwd=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["status"] == "failed" and batch["request_counts"]["total"] == 0
    [err] = batch["errors"]["data"]
    assert (err["code"], err["line"], err["param"]) == ("model_not_found", 1, "body.model")
    assert err["message"].startswith(
        f"The provided model {name!r} is not supported by the Batch API. It names the Hugging "
        f"Face hub model {name!r}, which is not in the local cache and cannot be fetched: the "
        "hub cannot be reached"
    ), err["message"]
    assert "Traceback" not in proc.stderr


def _cli_argv() -> list[str]:
    import sys

    return [sys.executable, "-m", "batchmlx.cli"]
