"""Image and video parts of chat and responses bodies (formats/media.py): what is accepted, the
bounds, and the per-line 400 of each refusal, naming the field."""

from __future__ import annotations

import base64

import pytest

from batchmlx.formats import media as M
from batchmlx.formats.media import text_only_error
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import MediaKind, MediaPart, MediaSource, RequestError, content_digest

CHAT, RESP = "/v1/chat/completions", "/v1/responses"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))


def data_url(data: bytes = PNG, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def chat(*parts, text: str = "What is this?") -> dict:
    content = [*parts, {"type": "text", "text": text}]
    return {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": content}]}  # fmt: skip


def image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_a_data_url_image_is_decoded_hashed_and_placed():
    p = parse_request(CHAT, chat(image(data_url(), detail="low")))
    assert not isinstance(p, RequestError), p
    assert p.messages[1] == {"role": "user", "content": "What is this?"}
    (part,) = p.media
    assert (part.kind, part.source, part.message) == (MediaKind.IMAGE, MediaSource.DATA, 1)
    assert (part.data, part.media_type, part.detail) == (PNG, "image/png", "low")
    assert part.param == "messages[1].content[0].image_url.url"
    assert part.digest == content_digest(part) and len(part.digest) == 16
    other = parse_request(CHAT, chat(image(data_url(PNG + b"x"))))
    assert not isinstance(other, RequestError)
    assert other.media[0].digest != part.digest  # another image, another key


def test_https_and_file_urls_are_left_for_the_worker():
    p = parse_request(CHAT, chat(image("https://example.com/a.png"), image("file:///tmp/b.png")))
    assert not isinstance(p, RequestError), p
    assert [(m.source, m.url, m.data) for m in p.media] == [
        (MediaSource.HTTPS, "https://example.com/a.png", None),
        (MediaSource.FILE, "/tmp/b.png", None),
    ]


def test_a_video_part_takes_fps_and_max_frames():
    part = {"type": "video_url", "video_url": {"url": "/v/a.mp4"}, "fps": 1, "max_frames": 8}
    p = parse_request(CHAT, chat(part))
    assert not isinstance(p, RequestError), p
    (v,) = p.media
    assert (v.kind, v.fps, v.max_frames, v.url) == (MediaKind.VIDEO, 1.0, 8, "/v/a.mp4")
    d = parse_request(CHAT, chat({"type": "video_url", "video_url": {"url": "/v/a.mp4"}}))
    assert not isinstance(d, RequestError)
    assert (d.media[0].fps, d.media[0].max_frames) == (M.DEFAULT_VIDEO_FPS, M.DEFAULT_VIDEO_FRAMES)
    # the same video at another fps is another cache key
    a = MediaPart(MediaKind.VIDEO, MediaSource.FILE, "p", 0, "/v", fps=1.0, max_frames=8)
    assert a.with_data(b"v", None).digest != (
        MediaPart(MediaKind.VIDEO, MediaSource.FILE, "p", 0, "/v", fps=2.0, max_frames=8)
        .with_data(b"v", None)
        .digest
    )


def test_responses_input_image():
    body = {"model": "m", "instructions": "Be brief.", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe"},
        {"type": "input_image", "image_url": data_url(), "detail": "high"}]}]}  # fmt: skip
    p = parse_request(RESP, body)
    assert not isinstance(p, RequestError), p
    (part,) = p.media
    assert (part.message, part.param, part.detail) == (1, "input[0].content[1].image_url", "high")
    assert p.messages[1]["content"] == "Describe"


BIG = M.MAX_MEDIA_BYTES + 1


@pytest.mark.parametrize(
    ("parts", "code", "param", "words"),
    [
        ([image("http://example.com/a.png")], "invalid_value",
         "messages[1].content[0].image_url.url", "https URL"),
        ([image("data:image/png;base64,@@@")], "invalid_value",
         "messages[1].content[0].image_url.url", "not valid base64"),
        ([image(data_url(media_type="text/plain"))], "invalid_value",
         "messages[1].content[0].image_url.url", "image/*"),
        ([image("data:image/png," + "AAAA")], "invalid_value",
         "messages[1].content[0].image_url.url", "base64,<data>"),
        ([image(data_url(b"\0" * BIG))], "invalid_value",
         "messages[1].content[0].image_url.url", f"at most {M.MAX_MEDIA_BYTES} bytes"),
        ([image(data_url(), detail="huge")], "invalid_value",
         "messages[1].content[0].image_url.detail", "'auto', 'low' and 'high'"),
        ([{"type": "image_url", "image_url": 3}], "invalid_type",
         "messages[1].content[0].image_url", "expected an object"),
        ([image("relative/a.png")], "invalid_value",
         "messages[1].content[0].image_url.url", "absolute file path"),
        ([image(data_url())] * (M.MAX_MEDIA_PARTS + 1), "invalid_value",
         f"messages[1].content[{M.MAX_MEDIA_PARTS}].image_url.url",
         f"at most {M.MAX_MEDIA_PARTS} images"),
        ([image(data_url(b"\0" * (M.MAX_MEDIA_BYTES - 10)))] * 3, "invalid_value",
         "messages[1].content[2].image_url.url", f"at most {M.MAX_REQUEST_MEDIA_BYTES} bytes"),
        ([{"type": "video_url", "video_url": {"url": "/v.mp4"}, "fps": 0}], "invalid_value",
         "messages[1].content[0].fps", "> 0"),
        ([{"type": "video_url", "video_url": {"url": "/v.mp4", "max_frames": 999}}],
         "invalid_value", "messages[1].content[0].max_frames", f"<= {M.MAX_VIDEO_FRAMES}"),
        ([{"type": "video_url", "video_url": {"url": "/v.mp4"}, "fps": "2"}], "invalid_type",
         "messages[1].content[0].fps", "a decimal"),
        ([{"type": "input_audio", "input_audio": {}}], "unsupported_value",
         "messages[1].content[0].type", "image_url"),
    ],
)  # fmt: skip
def test_refusals_are_the_lines_400_naming_the_field(parts, code, param, words):
    err = parse_request(CHAT, chat(*parts))
    assert isinstance(err, RequestError), err
    assert (err.status_code, err.code, err.param) == (400, code, param)
    assert param in err.message and words in err.message, err.message


def test_responses_refuses_a_file_id():
    body = {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]}  # fmt: skip
    err = parse_request(RESP, body)
    assert isinstance(err, RequestError)
    assert (err.code, err.param) == ("unsupported_parameter", "input[0].content[0].file_id")


def test_a_text_only_model_names_itself_and_the_part():
    p = parse_request(CHAT, chat(image(data_url())))
    assert not isinstance(p, RequestError)
    err = text_only_error("tiny-llama", p.media[0]).error
    assert (err.status_code, err.code, err.param) == (
        400,
        "unsupported_value",
        "messages[1].content[0].image_url.url",
    )
    assert "'tiny-llama' is text-only" in err.message and "image" in err.message
