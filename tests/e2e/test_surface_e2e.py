"""A file for each new endpoint (structured chat, responses, embeddings) through `batchmlx submit`
and the inbox, on the real default model; every output body validated with the openai types."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai.types import Batch, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tests.e2e.helpers import Cli, chat_body, describe, make_cli, read_jsonl, request_line
from tests.e2e.helpers import write_jsonl as write

pytestmark = pytest.mark.real_model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
QUESTIONS = ["Describe Paris.", "Describe Lima.", "Describe Oslo."]


def files() -> dict[str, list[dict[str, Any]]]:
    chat = [
        request_line(f"s{i}", chat_body(q, response_format=FORMAT, max_tokens=64, temperature=0.7,
                                        seed=i))
        for i, q in enumerate(QUESTIONS)
    ] + [request_line("obj", chat_body("Give a JSON object.", max_tokens=48, temperature=0,
                                        response_format={"type": "json_object"}))]  # fmt: skip
    text_format = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}
    responses = [
        request_line("plain", {"model": "gpt-4o-mini", "input": "Say hi.", "temperature": 0,
                               "max_output_tokens": 16, "instructions": "Be brief."},
                     url="/v1/responses"),
        request_line("json", {"model": "gpt-4o-mini", "input": [{"role": "user",
                              "content": "Describe Rome."}], "text": text_format,
                              "max_output_tokens": 64}, url="/v1/responses"),
        request_line("stored", {"model": "gpt-4o-mini", "input": "x", "store": True},
                     url="/v1/responses"),
    ]  # fmt: skip
    embeddings = [
        request_line("one", {"model": "text-embedding-3-small", "input": "The cat sat."},
                     url="/v1/embeddings"),
        request_line("many", {"model": "text-embedding-3-small", "input": ["a b", "c d e"],
                              "encoding_format": "base64", "dimensions": 64},
                     url="/v1/embeddings"),
    ]  # fmt: skip
    return {"chat": chat, "responses": responses, "embeddings": embeddings}


def check_outputs(name: str, out: list[dict[str, Any]], err: list[dict[str, Any]]) -> None:
    bodies = {ln["custom_id"]: ln["response"]["body"] for ln in out}
    if name == "chat":
        assert sorted(bodies) == ["obj", "s0", "s1", "s2"] and not err
        for cid, body in bodies.items():
            c = ChatCompletion.model_validate(body)
            text, finish = c.choices[0].message.content, c.choices[0].finish_reason
            if cid == "obj" and finish == "length":  # any object: it may outgrow max_tokens
                with pytest.raises(json.JSONDecodeError):
                    json.loads(text)
                continue
            assert finish == "stop", text  # bounded schema: it always ends
            jsonschema.validate(json.loads(text), SCHEMA if cid != "obj" else {"type": "object"})
    elif name == "responses":
        assert sorted(bodies) == ["json", "plain"]
        for body in bodies.values():
            r = Response.model_validate(body)
            assert r.object == "response" and r.usage.total_tokens > 0
        r = Response.model_validate(bodies["json"])
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        (bad,) = err
        assert bad["custom_id"] == "stored" and bad["response"]["status_code"] == 400
        assert bad["response"]["body"]["error"]["param"] == "store"
    else:
        assert sorted(bodies) == ["many", "one"] and not err
        one = CreateEmbeddingResponse.model_validate(bodies["one"])
        assert len(one.data) == 1 and len(one.data[0].embedding) == 576
        many = bodies["many"]
        assert len(many["data"]) == 2 and isinstance(many["data"][0]["embedding"], str)


@pytest.mark.parametrize("name", ["chat", "responses", "embeddings"])
def test_submit_each_endpoint(tmp_path: Path, name: str) -> None:
    cli = make_cli(tmp_path)
    path = write(tmp_path / f"{name}.jsonl", files()[name])
    proc = cli("submit", path, "--model", "default", "--wait", "--json")
    assert proc.returncode == 0, describe(proc)
    batch = Batch.model_validate(json.loads(proc.stdout))
    assert batch.status == "completed" and batch.usage is not None
    assert batch.usage.input_tokens > 0 and batch.model == "SmolLM2-135M-Instruct"
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert cli("results", batch.id, "-o", out).returncode == 0
    cli("results", batch.id, "--errors", "-o", err)
    check_outputs(name, read_jsonl(out), read_jsonl(err) if err.exists() else [])
    status = cli("status", batch.id)
    assert status.returncode == 0 and batch.endpoint in status.stdout, describe(status)


def test_inbox_runs_every_endpoint(tmp_path: Path) -> None:
    cli: Cli = make_cli(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for name, lines in files().items():
        for line in lines:
            line["body"]["model"] = "default"  # the inbox resolves the files' own model
        write(inbox / f"{name}.jsonl", lines)
    log = tmp_path / "worker.log"
    proc = cli.popen("worker", "--inbox", inbox, "--inbox-settle", "0.3", log=log)
    try:
        deadline = time.monotonic() + 600
        results = inbox / "results"  # {name}.{batch id}.output.jsonl / .errors.jsonl

        def found(name: str, kind: str) -> list[Path]:
            return list(results.glob(f"{name}.batch_*.{kind}.jsonl"))

        # the error file is written after the output file: wait for the one responses expects
        while not (all(found(n, "output") for n in files()) and found("responses", "errors")):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    for name in files():
        (output,) = found(name, "output")
        errors = found(name, "errors")
        check_outputs(name, read_jsonl(output),
                      read_jsonl(errors[0]) if errors else [])  # fmt: skip
