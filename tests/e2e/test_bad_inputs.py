"""A corpus of bad files: each gives a clear result (a failed batch whose errors name lines, or
per-line errors) and a good batch submitted before them is left exactly as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from tests.e2e.helpers import describe, make_cli
from tests.store_scenario import run_with_store

URL = "/v1/chat/completions"


def _req(cid: str, **body) -> dict:
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], **body}
    return {"custom_id": cid, "method": "POST", "url": URL, "body": body}


def _jsonl(*objs) -> bytes:
    return "".join(json.dumps(o) + "\n" for o in objs).encode()


GOOD = _jsonl(_req("g1"), _req("g2"))

CORPUS: dict[str, bytes] = {
    "broken_json": _jsonl(_req("a")) + b'{"custom_id": "b", \n',
    "missing_fields": _jsonl({"custom_id": "a", "method": "POST", "url": URL}),
    "duplicate_ids": _jsonl(_req("a"), _req("a")),
    "mixed_models": _jsonl(_req("a"), _req("b", model="HuggingFaceTB/other-model")),
    "stream_true": _jsonl(_req("a", stream=True)),
    "bom": b"\xef\xbb\xbf" + _jsonl(_req("a")),
    "crlf": _jsonl(_req("a"), _req("b")).replace(b"\n", b"\r\n"),
    "huge_line": _jsonl(_req("a", messages=[{"role": "user", "content": "x" * 5_000_000}])),
    "binary": bytes(range(256)) * 16,
    # orjson reads 1024 levels but writes 254: refused at validation, never half-stored
    "deep_nesting": _jsonl(_req("a", response_format={"x": json.loads("[" * 300 + "]" * 300)})),
    "empty": b"",
}


def test_bad_inputs_give_clear_results_and_touch_nothing_else(tmp_path: Path) -> None:
    outcomes: dict[str, str] = {}

    async def scenario(store: Store, settings: Settings) -> None:
        good = await batches.intake.submit(store, settings, GOOD, filename="good.jsonl", now=1.0)
        assert good.status is BatchStatus.IN_PROGRESS
        for name, data in CORPUS.items():
            rec = await batches.intake.submit(
                store, settings, data, filename=f"{name}.jsonl", now=2.0
            )
            if rec.status is BatchStatus.FAILED:
                assert rec.errors, name
                for e in rec.errors:
                    assert e.message and e.code, (name, e)
                outcomes[name] = "failed: " + ", ".join(
                    f"line {e.line} {e.code}" for e in rec.errors
                )
            else:
                assert rec.status is BatchStatus.IN_PROGRESS, name
                outcomes[name] = f"accepted {rec.request_counts.total}"
        after = await store.get_batch(good.id)
        assert after.status is BatchStatus.IN_PROGRESS
        assert after.request_counts.total == 2 and after.request_counts.completed == 0

    run_with_store(tmp_path, scenario)
    print(json.dumps(outcomes, indent=1))
    for name in ("broken_json", "missing_fields", "duplicate_ids", "mixed_models", "binary",
                 "empty", "deep_nesting"):  # fmt: skip
        assert outcomes[name].startswith("failed"), (name, outcomes[name])
    for name in ("broken_json", "missing_fields", "duplicate_ids", "mixed_models", "binary",
                 "deep_nesting"):  # fmt: skip
        assert "line None" not in outcomes[name], outcomes[name]  # errors name their line
    assert outcomes["deep_nesting"] == "failed: line 1 invalid_json_line"
    assert outcomes["empty"] == "failed: line None empty_file"
    # `stream: true` fails the file at its line, as OpenAI does
    assert outcomes["stream_true"] == "failed: line 1 streaming_unsupported"
    # a BOM, CRLF line ends and a line of several MB are fine as such
    for name in ("bom", "crlf", "huge_line"):
        assert outcomes[name].startswith("accepted"), (name, outcomes[name])


DEEP = _jsonl(_req("a", response_format={"x": json.loads("[" * 300 + "]" * 300)}))


def test_deep_nesting_over_http_fails_once_and_can_be_listed(tmp_path: Path) -> None:
    """The HTTP path: create (validating), then validate: failed with a line, never stuck."""

    async def scenario(store: Store, settings: Settings) -> None:
        f = await batches.files.store_file(
            store, settings, DEEP, filename="deep.jsonl", purpose="batch", now=1.0
        )
        rec = await batches.intake.create_batch(
            store, settings, input_file_id=f.id, endpoint=URL, now=1.0
        )
        assert rec.status is BatchStatus.VALIDATING
        rec = await batches.intake.validate_batch(store, settings, rec.id, now=2.0)
        assert rec.status is BatchStatus.FAILED
        assert [(e.line, e.code, e.param) for e in rec.errors] == [(1, "invalid_json_line", "body")]
        assert await store.batches_with_status(BatchStatus.VALIDATING) == []

    run_with_store(tmp_path, scenario)


def test_unreadable_input_file_fails_the_batch_once(tmp_path: Path) -> None:
    async def scenario(store: Store, settings: Settings) -> None:
        f = await batches.files.store_file(
            store, settings, GOOD, filename="good.jsonl", purpose="batch", now=1.0
        )
        Path(f.path).unlink()
        Path(f.path).mkdir()  # reading it raises IsADirectoryError, an OSError
        rec = await batches.intake.create_batch(
            store, settings, input_file_id=f.id, endpoint=URL, now=1.0
        )
        rec = await batches.intake.validate_batch(store, settings, rec.id, now=2.0)
        assert rec.status is BatchStatus.FAILED
        assert "cannot be read" in rec.errors[0].message, rec.errors

    run_with_store(tmp_path, scenario)


def test_a_submit_that_cannot_be_stored_leaves_no_file(tmp_path: Path) -> None:
    """A source that is not UTF-8 cannot go into the database: the submit raises, and neither
    the input file's bytes nor its record stay behind. A file name that is not UTF-8 is kept
    as text."""

    async def scenario(store: Store, settings: Settings) -> None:
        bad = "caf\udce9.jsonl"  # how os.listdir gives the name b"caf\xe9.jsonl"
        try:
            await batches.intake.submit(
                store, settings, GOOD, now=1.0, filename="ok.jsonl", source=bad
            )
        except UnicodeEncodeError:
            pass
        else:
            raise AssertionError("a source the database cannot hold was stored")
        assert list(settings.files_dir.iterdir()) == []
        assert await store.list_files_page() == []
        assert await store.list_batches() == []
        rec = await batches.intake.submit(store, settings, GOOD, now=1.0, filename=bad)
        assert rec.status is BatchStatus.IN_PROGRESS
        assert [f.filename for f in await store.list_files_page()] == ["caf\\xe9.jsonl"]

    run_with_store(tmp_path, scenario)


def test_cli_submit_of_bad_input_says_which_line(tmp_path: Path) -> None:
    cli = make_cli(tmp_path)
    deep = tmp_path / "deep.jsonl"
    deep.write_bytes(DEEP)
    garbage = tmp_path / os.fsdecode(b"caf\xe9.jsonl")
    garbage.write_bytes(b"x\n" * 1_000)
    for path, says in ((deep, "line 1"), (garbage, "1,000 in all")):
        proc = cli("submit", path, "--model", "default", timeout=120)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 1 and "Traceback" not in text, describe(proc)
        assert says in text, describe(proc)
    # one input file per failed batch, nothing else under files/
    assert len(list((cli.home / "files").iterdir())) == 2
