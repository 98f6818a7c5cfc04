"""The model rule on every intake path, against a real store (SQLite and PostgreSQL): `submit`
(the CLI's), the HTTP API's create-then-validate (serve's rule) and the inbox, for a file
written for OpenAI (`"model": "gpt-4o-mini"`). No model is loaded here (tests/e2e runs one)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import store_file
from batchmlx.batches.intake import create_batch, submit, validate_batch
from batchmlx.batches.models import serving_rule
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchRecord
from batchmlx.ingest.inbox import Inbox
from batchmlx.store import Store

OPENAI_SENTENCE = "The provided model {!r} is not supported by the Batch API."


def _later() -> float:
    """A clock past every settle time: a scan takes each quiet file at once."""
    return time.time() + 100.0


def openai_file(model: str = "gpt-4o-mini", n: int = 2) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": f"q{i}"}],
                  "max_tokens": 4}}
        for i in range(n)
    ]  # fmt: skip
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@pytest.fixture
def folder(tmp_path: Path) -> str:
    """A folder that resolves as a local MLX model (nothing here loads it)."""
    path = tmp_path / "local-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


@pytest.fixture
def with_settings(
    store_target: str | Path, tmp_path: Path
) -> Callable[[Callable[[Store, Settings], Awaitable[Any]], Settings | None], Any]:
    url = store_target if isinstance(store_target, str) else f"sqlite:///{store_target}"
    base = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", database=url)

    def run(fn, settings: Settings | None = None) -> Any:
        async def main() -> Any:
            s = settings or base
            store = await Store.from_settings(s)
            try:
                return await fn(store, s)
            finally:
                await store.close()

        return asyncio.run(main())

    run.base = base  # type: ignore[attr-defined]
    return run


async def via_cli(store: Store, settings: Settings, data: bytes, **kw: Any) -> BatchRecord:
    return await submit(store, settings, data, filename="f.jsonl", now=100.0, **kw)


async def via_http(store: Store, settings: Settings, data: bytes, served: str) -> BatchRecord:
    """What serve does: store the upload, create the batch, validate it under serve's rule."""
    from batchmlx.batches.files import Hashed

    f = await store_file(store, settings, Hashed(data), filename="f.jsonl", purpose="batch",
                         now=100.0)  # fmt: skip
    rec = await create_batch(store, settings, input_file_id=f.id,
                             endpoint="/v1/chat/completions", now=100.0)  # fmt: skip
    return await validate_batch(store, settings, rec.id, now=100.0,
                                rule=serving_rule(settings, served))  # fmt: skip


async def via_inbox(store: Store, settings: Settings, data: bytes, inbox: Path) -> BatchRecord:
    inbox.mkdir(exist_ok=True)
    (inbox / "f.jsonl").write_bytes(data)
    box = Inbox(settings, inbox, clock=_later)
    made = await box.scan(store)
    assert len(made) == 1, made
    return made[0]


def test_an_openai_named_file_runs_on_the_default_model_on_every_path(with_settings, tmp_path):
    async def scenario(store: Store, settings: Settings) -> None:
        cli = await via_cli(store, settings, openai_file())
        http = await via_http(store, settings, openai_file(), "default")
        inbox = await via_inbox(store, settings, openai_file(n=3), tmp_path / "inbox")
        for rec in (cli, http, inbox):
            assert rec.status is BatchStatus.IN_PROGRESS, rec.errors
            assert rec.model == "default"
            assert rec.errors == ()

    with_settings(scenario)


def _refused(rec: BatchRecord, name: str = "gpt-4o-mini") -> str:
    assert rec.status is BatchStatus.FAILED
    [err] = rec.errors
    assert (err.code, err.line, err.param) == ("model_not_found", 1, "body.model")
    assert err.message.startswith(OPENAI_SENTENCE.format(name) + " ")
    return err.message


def test_strict_refuses_the_openai_name_on_every_path(with_settings, tmp_path):
    strict = dataclasses.replace(with_settings.base, strict_models=True)

    async def scenario(store: Store, settings: Settings) -> None:
        cli = _refused(await via_cli(store, settings, openai_file()))
        assert "Use 'default' (SmolLM2-135M-Instruct), a local MLX folder" in cli
        http = _refused(await via_http(store, settings, openai_file(), "default"))
        assert "This server serves 'default' (SmolLM2-135M-Instruct)" in http
        inbox = tmp_path / "inbox"
        rec = await via_inbox(store, settings, openai_file(), inbox)
        _refused(rec)
        report = json.loads((inbox / "failed" / "f.errors.json").read_text())
        assert report["errors"]["data"][0]["code"] == "model_not_found"
        # a name of a model is still served
        assert (await via_cli(store, settings, openai_file("default"))).model == "default"

    with_settings(scenario, strict)


def test_an_alias_sends_the_name_to_its_model(with_settings, folder):
    aliased = dataclasses.replace(
        with_settings.base, strict_models=True, model_aliases=(("gpt-4o-mini", folder),)
    )

    async def scenario(store: Store, settings: Settings) -> None:
        rec = await via_cli(store, settings, openai_file())
        assert (rec.status, rec.model) == (BatchStatus.IN_PROGRESS, folder)
        # --model is looked up in the aliases too
        rec = await via_cli(store, settings, openai_file("x"), model="gpt-4o-mini")
        assert rec.model == folder
        # serve runs one model: an alias must name it (refused at start)
        with pytest.raises(ValueError, match="serve runs one model"):
            serving_rule(settings, "default")
        ok = dataclasses.replace(settings, model_aliases=(("gpt-4o-mini", "default"),))
        rec = await via_http(store, ok, openai_file(), "default")
        assert (rec.status, rec.model) == (BatchStatus.IN_PROGRESS, "default")

    with_settings(scenario, aliased)


def test_the_inbox_runs_the_same_content_again_with_another_model(with_settings, folder, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()

    async def drop(store: Store, settings: Settings, data: bytes, model: str | None = None):
        (inbox / "f.jsonl").write_bytes(data)
        return await Inbox(settings, inbox, model=model, clock=_later).scan(store)

    async def scenario(store: Store, settings: Settings) -> None:
        data = openai_file("default")
        [first] = await drop(store, settings, data)
        assert first.model == "default"
        assert await drop(store, settings, data) == []  # the same content, the same model
        assert await drop(store, settings, data, "default") == []  # named so by --model
        [other] = await drop(store, settings, data, folder)  # the same content, another model
        assert (other.status, other.model) == (BatchStatus.IN_PROGRESS, folder)
        assert await drop(store, settings, data, folder) == []
        # an OpenAI-named file, then an alias that sends its name to another model
        openai = openai_file()
        [served] = await drop(store, settings, openai)
        assert served.model == "default"
        remapped = dataclasses.replace(settings, model_aliases=(("gpt-4o-mini", folder),))
        [aliased] = await drop(store, remapped, openai)
        assert aliased.model == folder
        assert await drop(store, remapped, openai) == []
        assert len(list((inbox / "done").iterdir())) == 8  # every drop moved aside

    with_settings(scenario)


def test_a_hub_id_that_cannot_be_fetched_fails_validation(with_settings, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as without a network, and deterministic
    name = "batchmlx-tests/never-downloaded"

    async def scenario(store: Store, settings: Settings) -> None:
        for strict in (False, True):
            s = dataclasses.replace(settings, strict_models=True) if strict else settings
            message = _refused(await via_cli(store, s, openai_file(name)), name)
            assert "not in the local cache and cannot be fetched" in message
            assert "HF_HUB_OFFLINE" in message
        with pytest.raises(BatchError, match="cannot be resolved.*cannot be fetched"):
            await via_cli(store, settings, openai_file(), model=name)
        # serve never fetches what a client names: its model answers
        rec = await via_http(store, settings, openai_file(name), "default")
        assert (rec.status, rec.model) == (BatchStatus.IN_PROGRESS, "default")

    with_settings(scenario)
