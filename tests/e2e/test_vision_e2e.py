"""Image lines end to end on a tiny random-weight LLaVA (tests/tiny_vlm.py): `submit --wait`,
the inbox and HTTP (a batch and an online request) through the real SQLite queue and the real
MLX path; the refusals (https without a network, a file outside the allowed folder, a text-only
model) are per-line 400s naming the field and the model."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.e2e.helpers import describe, make_cli, request_line, run_through_inbox, write_jsonl
from tests.server.helpers import start_server
from tests.tiny_vlm import png

pytest.importorskip("mlx_vlm")

SYSTEM = "You are a careful assistant who looks at pictures and answers in one short sentence."


def url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat(image_url: str | None, question: str, **extra) -> dict:
    content: list[dict] = [{"type": "text", "text": question}]
    if image_url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": 5, **extra,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": content}]}  # fmt: skip


def lines(folder: Path) -> list[dict]:
    (folder / "cat.png").write_bytes(png(3))
    return [
        request_line("first", chat(url(png(1)), "What is in this picture?")),
        request_line("again", chat(url(png(1)), "What is in this picture?")),
        request_line("other_image", chat(url(png(2)), "What is in this picture?")),
        request_line("other_question", chat(url(png(1)), "Which colour is most common?")),
        request_line("file", chat(str(folder / "cat.png"), "What is this?")),
        request_line("https", chat("https://example.invalid/cat.png", "What is this?")),
        request_line("outside", chat("/etc/hostname", "What is this?")),
    ]  # fmt: skip


def by_id(text: str) -> dict[str, dict]:
    rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return {r["custom_id"]: r["response"] for r in rows}


def test_an_image_batch_through_submit_the_inbox_and_http(tmp_path, tiny_vlm_dir, monkeypatch):
    allowed = tmp_path / "images"
    allowed.mkdir()
    monkeypatch.setenv("BATCHMLX_MEDIA_DIR", str(allowed))
    monkeypatch.setenv("BATCHMLX_MEDIA_FETCH", "off")  # as on a machine with no network
    cli = make_cli(tmp_path)
    path = write_jsonl(tmp_path / "images.jsonl", lines(allowed))
    model = str(tiny_vlm_dir)
    proc = cli("submit", path, "--model", model, "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 7, "completed": 5, "failed": 2}, batch
    out = by_id(cli("results", batch["id"]).stdout)
    errors = by_id(cli("results", batch["id"], "--errors").stdout)

    def cached(cid: str) -> int:
        return out[cid]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]

    answer = {cid: r["body"]["choices"][0]["message"]["content"] for cid, r in out.items()}
    prompt = out["again"]["body"]["usage"]["prompt_tokens"]
    # the same image and prompt: whichever ran second is a HIT (all but the last token's block)
    assert max(cached("first"), cached("again")) == (prompt - 1) // 16 * 16 > 0
    assert answer["again"] == answer["first"]
    assert cached("other_image") < cached("other_question")  # the image's blocks are not reused
    assert cached("other_question") > 16  # the system prompt and the image's blocks are
    assert out["file"]["status_code"] == 200

    https = errors["https"]["body"]["error"]
    assert (errors["https"]["status_code"], https["param"]) == (
        400,
        "messages[1].content[0].image_url.url",
    )
    assert "give the image as a data: URL" in https["message"]
    outside = errors["outside"]["body"]["error"]
    assert (
        outside["code"] == "unsupported_value"
        and "outside the allowed folder" in (outside["message"])
    )

    # the inbox takes the same file into a batch of the same model
    inbox_batch = run_through_inbox(cli, tmp_path, path, model, besides=batch["id"])
    assert inbox_batch["request_counts"]["completed"] == 5, inbox_batch
    again = by_id(cli("results", inbox_batch["id"]).stdout)
    assert {c: r["body"]["choices"][0]["message"]["content"] for c, r in again.items()} == answer

    # HTTP: online chat and responses requests with an image, on the same model
    server = start_server(tmp_path / "srv", "--model", model)
    try:
        client = server.client()
        reply = client.chat.completions.create(**chat(url(png(1)), "What is in this picture?"))
        response = client.responses.create(model="m", max_output_tokens=16, temperature=0,
            input=[{"role": "user", "content": [
                {"type": "input_text", "text": "Describe it."},
                {"type": "input_image", "image_url": url(png(1)), "detail": "auto"}]}])  # fmt: skip
    finally:
        server.stop()
    assert reply.choices[0].message.content == answer["first"]
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 16


def test_a_text_only_model_refuses_an_image_line(tmp_path, tiny_model_dir):
    cli = make_cli(tmp_path)
    path = write_jsonl(
        tmp_path / "one.jsonl",
        [request_line("img", chat(url(png(1)), "Hi?")), request_line("txt", chat(None, "Hi?"))],
    )
    proc = cli("submit", path, "--model", str(tiny_model_dir), "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, batch
    err = by_id(cli("results", batch["id"], "--errors").stdout)["img"]
    assert err["status_code"] == 400
    e = err["body"]["error"]
    assert (e["code"], e["param"]) == ("unsupported_value", "messages[1].content[0].image_url.url")
    assert f"the model '{tiny_model_dir}' is text-only" in e["message"]


def test_the_image_example_runs_on_a_vision_model(tmp_path, tiny_vlm_dir):
    cli = make_cli(tmp_path)
    example = Path(__file__).resolve().parents[2] / "jobs" / "examples" / "images.jsonl"
    proc = cli("submit", example, "--model", str(tiny_vlm_dir), "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}, batch
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] > 16  # the repeated images
