"""Image and video content parts of chat and responses bodies → `MediaPart`, or the line's 400.

Accepted parts (OpenAI's, plus vllm-mlx's video part):
- chat `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (a bare url string too);
- responses `{"type": "input_image", "image_url": ..., "detail": ...}`;
- chat `{"type": "video_url", "video_url": {"url": ...}, "fps": ..., "max_frames": ...}` (fps and
  max_frames may also sit inside `video_url`).
A url is a `data:<media type>;base64,...` URL (decoded and hashed here, once per request), an
https URL, or a local file path (`file://` or absolute): those two are fetched or read later by
the worker (worker/media.py), which may still refuse them. Pure: no network, no files.

Every bound below is per request (one batch line) and named once here.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import Reject, fail, is_int, type_error
from batchmlx.formats.request import MediaKind, MediaPart, MediaSource

MAX_MEDIA_PARTS = 8  # image and video parts in one request
MAX_MEDIA_BYTES = 20 * 1024 * 1024  # bytes of one image or video, once decoded or fetched
MAX_REQUEST_MEDIA_BYTES = 50 * 1024 * 1024  # bytes of all the request's images and videos
MAX_VIDEO_FRAMES = 128  # the largest max_frames a video part may ask for
MAX_VIDEO_FPS = 30.0  # the highest sampling rate a video part may ask for
DEFAULT_VIDEO_FPS = 2.0  # frames sampled per second when a video part names none
DEFAULT_VIDEO_FRAMES = 32  # frames at most when a video part names no max_frames
DETAILS = ("auto", "low", "high")  # OpenAI's image detail levels (a hint; see README)


def _invalid(param: str, why: str) -> Reject:
    return fail(ErrorCode.INVALID_VALUE, f"Invalid '{param}': {why}", param)


def _decode_data_url(url: str, param: str, kind: MediaKind) -> tuple[str, bytes]:
    """(media type, bytes) of `data:<type>;base64,<payload>`."""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise _invalid(param, "a data URL must be of the form data:<media type>;base64,<data>.")
    media_type = head[len("data:") : -len(";base64")].strip().lower()
    if not media_type.startswith(f"{kind.value}/"):
        raise _invalid(param, f"expected a data URL of {kind.value}/* content, got {media_type!r}.")
    # the size bound before decoding: base64 is 4 characters per 3 bytes
    if len(payload) * 3 // 4 > MAX_MEDIA_BYTES + 3:
        raise _too_large(param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid(param, "the data URL is not valid base64.") from None
    if not data:
        raise _invalid(param, "the data URL holds no bytes.")
    if len(data) > MAX_MEDIA_BYTES:
        raise _too_large(param)
    return media_type, data


def _too_large(param: str) -> Reject:
    return _invalid(param, f"an image or video may be at most {MAX_MEDIA_BYTES} bytes.")


def _url_part(kind: MediaKind, url: Any, param: str, message: int, **extra: Any) -> MediaPart:
    if not isinstance(url, str):
        raise type_error(param, "a string", url)
    if url.startswith("data:"):
        media_type, data = _decode_data_url(url, param, kind)
        part = MediaPart(kind, MediaSource.DATA, param, message, f"data:{media_type}", **extra)
        return part.with_data(data, media_type)
    if url.startswith("https://") and len(url) > len("https://"):
        return MediaPart(kind, MediaSource.HTTPS, param, message, url, **extra)
    if url.startswith("file://") or url.startswith("/"):
        path = url[len("file://") :] if url.startswith("file://") else url
        if not path.startswith("/"):
            raise _invalid(param, "a file URL must name an absolute path.")
        return MediaPart(kind, MediaSource.FILE, param, message, path, **extra)
    raise _invalid(
        param,
        f"expected a data:{kind.value}/...;base64 URL, an https URL or an absolute file path.",
    )


def _detail(value: Any, param: str) -> str:
    if value is None:
        return "auto"
    if value not in DETAILS:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for '{param}': {value!r}. Supported values are: 'auto', 'low' and "
            "'high'.",
            param,
        )
    return str(value)


def chat_image(part: dict[str, Any], at: str, message: int) -> MediaPart:
    """A chat `image_url` part."""
    image = part.get("image_url")
    if isinstance(image, str):  # vLLM and vllm-mlx accept the bare url
        return _url_part(MediaKind.IMAGE, image, f"{at}.image_url", message)
    if not isinstance(image, dict):
        raise type_error(f"{at}.image_url", "an object", image)
    detail = _detail(image.get("detail"), f"{at}.image_url.detail")
    return _url_part(MediaKind.IMAGE, image.get("url"), f"{at}.image_url.url", message,
                     detail=detail)  # fmt: skip


def responses_image(part: dict[str, Any], at: str, message: int) -> MediaPart:
    """A responses `input_image` part (image_url a string; file ids are OpenAI's storage)."""
    if part.get("file_id") is not None:
        raise fail(
            ErrorCode.UNSUPPORTED_PARAMETER,
            f"Unsupported parameter: '{at}.file_id'. batchmlx keeps no uploaded images; give "
            "the image as image_url.",
            f"{at}.file_id",
        )
    detail = _detail(part.get("detail"), f"{at}.detail")
    return _url_part(MediaKind.IMAGE, part.get("image_url"), f"{at}.image_url", message,
                     detail=detail)  # fmt: skip


def chat_video(part: dict[str, Any], at: str, message: int) -> MediaPart:
    """A `video_url` part, with fps and max_frames beside it or inside video_url."""
    video = part.get("video_url")
    inner: dict[str, Any] = {}
    if isinstance(video, dict):
        inner, url, where = video, video.get("url"), f"{at}.video_url.url"
    elif isinstance(video, str):
        url, where = video, f"{at}.video_url"
    else:
        raise type_error(f"{at}.video_url", "an object", video)
    fps = part.get("fps", inner.get("fps"))
    if fps is None:
        fps = DEFAULT_VIDEO_FPS
    elif not isinstance(fps, int | float) or isinstance(fps, bool):
        raise type_error(f"{at}.fps", "a decimal", fps)
    elif not 0 < fps <= MAX_VIDEO_FPS:
        raise _invalid(f"{at}.fps", f"expected a value > 0 and <= {MAX_VIDEO_FPS}.")
    frames = part.get("max_frames", inner.get("max_frames"))
    if frames is None:
        frames = DEFAULT_VIDEO_FRAMES
    elif not is_int(frames):
        raise type_error(f"{at}.max_frames", "an integer", frames)
    elif not 1 <= frames <= MAX_VIDEO_FRAMES:
        raise _invalid(f"{at}.max_frames", f"expected a value >= 1 and <= {MAX_VIDEO_FRAMES}.")
    return _url_part(MediaKind.VIDEO, url, where, message, fps=float(fps), max_frames=frames)


def check_media_bounds(parts: list[MediaPart]) -> None:
    """The request-wide bounds: part count, and the bytes known so far (data: URLs)."""
    if len(parts) > MAX_MEDIA_PARTS:
        raise _invalid(
            parts[MAX_MEDIA_PARTS].param,
            f"a request may hold at most {MAX_MEDIA_PARTS} images and videos, got {len(parts)}.",
        )
    check_total_bytes(parts)


def check_total_bytes(parts: list[MediaPart] | tuple[MediaPart, ...]) -> None:
    total = 0
    for part in parts:
        total += len(part.data or b"")
        if total > MAX_REQUEST_MEDIA_BYTES:
            raise _invalid(
                part.param,
                f"the images and videos of one request may hold at most "
                f"{MAX_REQUEST_MEDIA_BYTES} bytes in all.",
            )


def text_only_error(model: str, part: MediaPart) -> Reject:
    """A text-only model given an image or video: the line's 400, never a dropped image."""
    return fail(
        ErrorCode.UNSUPPORTED_VALUE,
        f"Unsupported value for '{part.param}': the model '{model}' is text-only and cannot "
        f"take {part.kind.value} content; use a vision-language model.",
        part.param,
    )
