"""Video lines end to end on a tiny random-weight Qwen2-VL (tests/tiny_vlm.py): `submit --wait`,
the inbox and HTTP (an online request) through the real SQLite queue and the real MLX path,
with the prefix cache's video cases in `cached_tokens`; a video PyAV cannot decode, a video on
an image-only model and a video on a text-only model are 400s naming the field (and the
model)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from openai import BadRequestError

from tests.e2e.helpers import describe, make_cli, request_line, run_through_inbox, write_jsonl
from tests.server.helpers import start_server
from tests.tiny_vlm import png, video

pytest.importorskip("mlx_vlm")
pytest.importorskip("av")

SYSTEM = "You are a careful assistant who watches short clips and answers in one short sentence."
FIELD = "messages[1].content[0].video_url.url"


def video_url(clip: bytes) -> str:
    return "data:video/x-msvideo;base64," + base64.b64encode(clip).decode()


def chat(media: dict | None, question: str) -> dict:
    content: list[dict] = [{"type": "text", "text": question}]
    if media is not None:
        content.insert(0, media)
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": 5,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": content}]}  # fmt: skip


def clip(data: bytes | str) -> dict:
    url = data if isinstance(data, str) else video_url(data)
    return {"type": "video_url", "video_url": {"url": url}, "fps": 4, "max_frames": 8}


def by_id(text: str) -> dict[str, dict]:
    rows = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
    return {r["custom_id"]: r["response"] for r in rows}


def submit(cli, path: Path, model: Path) -> dict:
    proc = cli("submit", path, "--model", str(model), "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    return json.loads(proc.stdout)


def test_a_video_batch_through_submit_the_inbox_and_http(tmp_path, tiny_qwen2_vl_dir, monkeypatch):
    allowed = tmp_path / "videos"
    allowed.mkdir()
    (allowed / "clip.avi").write_bytes(video(1))
    monkeypatch.setenv("BATCHMLX_MEDIA_DIR", str(allowed))
    cli = make_cli(tmp_path)
    path = write_jsonl(tmp_path / "videos.jsonl", [
        request_line("first", chat(clip(video(1)), "What happens in this clip?")),
        request_line("again", chat(clip(video(1)), "What happens in this clip?")),
        request_line("other_video", chat(clip(video(2)), "What happens in this clip?")),
        request_line("other_question", chat(clip(video(1)), "Which colour is most common?")),
        request_line("file", chat(clip(str(allowed / "clip.avi")), "What happens?")),
        request_line("image", chat({"type": "image_url", "image_url": {"url":
            "data:image/png;base64," + base64.b64encode(png(1)).decode()}}, "What is this?")),
        request_line("junk", chat(clip(b"these bytes are no video"), "What happens?")),
    ])  # fmt: skip
    batch = submit(cli, path, tiny_qwen2_vl_dir)
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 7, "completed": 6, "failed": 1}, batch
    out = by_id(cli("results", batch["id"]).stdout)
    errors = by_id(cli("results", batch["id"], "--errors").stdout)

    def cached(cid: str) -> int:
        return out[cid]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]

    answer = {cid: r["body"]["choices"][0]["message"]["content"] for cid, r in out.items()}
    prompt = out["again"]["body"]["usage"]["prompt_tokens"]
    assert prompt > 16 + 16  # the system prompt's block, and the clip's 16 placeholder tokens
    # the same clip and prompt: whichever ran second is a HIT (all but the last token's block)
    assert max(cached("first"), cached("again")) == (prompt - 1) // 16 * 16
    assert answer["again"] == answer["first"]
    assert cached("other_video") < cached("other_question")  # the clip's blocks not reused
    assert cached("other_question") > 16  # the system prompt's and the clip's blocks are
    assert answer["file"] is not None and out["image"]["status_code"] == 200

    junk = errors["junk"]
    assert junk["status_code"] == 400
    e = junk["body"]["error"]
    assert (e["code"], e["param"]) == ("invalid_value", FIELD)
    assert "not a video PyAV can decode" in e["message"]

    # the inbox takes the same file into a batch of the same model, with the same answers
    inbox_batch = run_through_inbox(cli, tmp_path, path, tiny_qwen2_vl_dir, besides=batch["id"])
    assert inbox_batch["request_counts"] == {"total": 7, "completed": 6, "failed": 1}
    again = by_id(cli("results", inbox_batch["id"]).stdout)
    assert {c: r["body"]["choices"][0]["message"]["content"] for c, r in again.items()} == answer

    # HTTP: an online chat request with the clip, and one with an undecodable clip
    server = start_server(tmp_path / "srv", "--model", str(tiny_qwen2_vl_dir))
    try:
        client = server.client()
        reply = client.chat.completions.create(**chat(clip(video(1)), "What happens in this clip?"))
        with pytest.raises(BadRequestError) as refused:
            client.with_options(max_retries=0).chat.completions.create(
                **chat(clip(b"these bytes are no video"), "What happens?")
            )
    finally:
        server.stop()
    assert reply.choices[0].message.content == answer["first"]
    assert reply.usage.prompt_tokens == prompt
    assert refused.value.status_code == 400 and FIELD in str(refused.value), refused.value


def test_models_that_take_no_video_refuse_the_line(tmp_path, tiny_vlm_dir, tiny_model_dir):
    cli = make_cli(tmp_path)
    path = write_jsonl(tmp_path / "one.jsonl", [
        request_line("vid", chat(clip(video(1)), "What happens?")),
        request_line("txt", chat(None, "Hi?"))])  # fmt: skip
    for model, says in ((tiny_vlm_dir, "(llava) takes no video"), (tiny_model_dir, "is text-only")):
        batch = submit(cli, path, model)
        assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}, batch
        err = by_id(cli("results", batch["id"], "--errors").stdout)["vid"]
        assert err["status_code"] == 400
        e = err["body"]["error"]
        assert (e["code"], e["param"]) == ("unsupported_value", FIELD)
        assert f"the model '{model}' " in e["message"] and says in e["message"], e


def test_the_video_example_runs_on_a_video_model(tmp_path, tiny_qwen2_vl_dir):
    cli = make_cli(tmp_path)
    example = Path(__file__).resolve().parents[2] / "jobs" / "examples" / "videos.jsonl"
    batch = submit(cli, example, tiny_qwen2_vl_dir)
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, batch
    assert batch["usage"]["input_tokens_details"]["cached_tokens"] > 16  # the repeated clip
