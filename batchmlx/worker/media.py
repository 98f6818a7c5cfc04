"""The bytes of a request's https and file images and videos, under bounds, or the line's 400.

formats/media.py decodes data: URLs; the parts it leaves here are read once per request:
- https URLs are fetched with a time limit (`FETCH_TIMEOUT_S`) and the size bound of one part
  (formats.media.MAX_MEDIA_BYTES); where the machine has no network (or fetching is turned off
  with $BATCHMLX_MEDIA_FETCH=off) the line gets a 400 saying so;
- file paths are read only inside the folder $BATCHMLX_MEDIA_DIR names (after resolving links);
  with none set, every file part is refused.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import Reject
from batchmlx.formats.media import MAX_MEDIA_BYTES, check_total_bytes
from batchmlx.formats.request import MediaPart, MediaSource, RequestError

MEDIA_DIR_ENV = "BATCHMLX_MEDIA_DIR"  # the one folder file images may be read from
MEDIA_FETCH_ENV = "BATCHMLX_MEDIA_FETCH"  # "off": https images are refused, never fetched
FETCH_TIMEOUT_S = 10.0  # the whole fetch of one https image

Fetch = Callable[[str, float, int], tuple[bytes, str | None]]  # url, timeout, limit → data, type


class MediaRefused(Exception):
    def __init__(self, error: RequestError) -> None:
        self.error = error


def _refuse(part: MediaPart, why: str, code: ErrorCode = ErrorCode.INVALID_VALUE) -> MediaRefused:
    message = f"Invalid '{part.param}': {why}"
    return MediaRefused(RequestError(400, code.value, message, part.param))


def fetch_https(url: str, timeout_s: float, limit: int) -> tuple[bytes, str | None]:
    """GET url: its bytes (at most limit + 1 read) and content type."""
    req = urllib.request.Request(url, headers={"User-Agent": "batchmlx"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (https only)
        data = resp.read(limit + 1)
        return data, resp.headers.get_content_type()


@dataclass(frozen=True, slots=True)
class MediaReader:
    """Fills in the bytes of https and file parts (hashing them once, MediaPart.with_data)."""

    media_dir: Path | None = None  # None: file parts refused
    fetch_enabled: bool = True
    fetch: Fetch = fetch_https
    timeout_s: float = FETCH_TIMEOUT_S

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MediaReader:
        env = dict(os.environ) if env is None else env
        folder = env.get(MEDIA_DIR_ENV)
        return cls(
            media_dir=Path(folder).expanduser().resolve() if folder else None,
            fetch_enabled=env.get(MEDIA_FETCH_ENV, "").lower() not in ("off", "0", "false"),
        )

    def resolve(self, parts: tuple[MediaPart, ...]) -> tuple[MediaPart, ...]:
        """Every part with its bytes; raises MediaRefused with the line's 400."""
        out = tuple(p if p.data is not None else self._read(p) for p in parts)
        try:
            check_total_bytes(out)
        except Reject as reject:
            raise MediaRefused(reject.error) from None
        return out

    def _read(self, part: MediaPart) -> MediaPart:
        if part.source is MediaSource.FILE:
            return self._file(part)
        if not self.fetch_enabled:
            kind = part.kind.value
            raise _refuse(part, f"fetching https {kind}s is turned off here (${MEDIA_FETCH_ENV}); "
                          f"give the {kind} as a data: URL.")  # fmt: skip
        try:
            data, media_type = self.fetch(part.url, self.timeout_s, MAX_MEDIA_BYTES)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = getattr(exc, "reason", exc)
            kind = part.kind.value
            raise _refuse(part, f"the {kind} could not be fetched ({why}); this machine may have "
                          f"no network: give the {kind} as a data: URL.") from None  # fmt: skip
        if len(data) > MAX_MEDIA_BYTES:
            raise _refuse(part, f"an image or video may be at most {MAX_MEDIA_BYTES} bytes.")
        return part.with_data(data, media_type)

    def _file(self, part: MediaPart) -> MediaPart:
        if self.media_dir is None:
            why = f"local files are read only inside a folder the user allows (${MEDIA_DIR_ENV})"
            raise _refuse(part, f"{why}; none is set.", ErrorCode.UNSUPPORTED_VALUE)
        path = Path(part.url).resolve()
        if not path.is_relative_to(self.media_dir):
            raise _refuse(part, f"the file is outside the allowed folder {self.media_dir}.",
                          ErrorCode.UNSUPPORTED_VALUE)  # fmt: skip
        try:
            size = path.stat().st_size
            if size > MAX_MEDIA_BYTES:
                raise _refuse(part, f"an image or video may be at most {MAX_MEDIA_BYTES} bytes.")
            data = path.read_bytes()
        except OSError as exc:
            raise _refuse(part, f"the file cannot be read ({exc.strerror}).") from None
        return part.with_data(data, None)
