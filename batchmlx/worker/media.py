"""The bytes of a request's https and file images and videos, under bounds, or the line's 400.

formats/media.py decodes data: URLs; the parts it leaves here are read once per request, off
the engine's thread (worker/media_pool.py runs `resolve` on its fetch threads):
- https URLs are fetched by worker/fetch.py: one deadline for the whole fetch, redirects only
  to https, loopback/private/link-local addresses refused unless the operator allows them,
  and the size bound of one part (formats.media.MAX_MEDIA_BYTES); where the machine has no
  network (or fetching is turned off, config.MediaSettings.fetch) the line gets a 400 saying so;
- file paths are read only inside the folder config.MediaSettings.media_dir names (after
  resolving links); with none set, every file part is refused.
The switches come from config.py ($BATCHMLX_MEDIA_DIR, $BATCHMLX_MEDIA_FETCH,
$BATCHMLX_MEDIA_FETCH_PRIVATE); nothing here reads the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchmlx.config import MEDIA_DIR_ENV, MEDIA_FETCH_ENV, MediaSettings
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import Reject
from batchmlx.formats.media import MAX_MEDIA_BYTES, check_total_bytes
from batchmlx.formats.request import MediaPart, MediaSource, RequestError
from batchmlx.worker.fetch import Cancel, Cancelled, FetchRefused, HttpsFetch, TooLarge

# url, size limit, cancel → data (at most limit + 1 bytes), content type; or FetchRefused
Fetch = Callable[[str, int, Cancel | None], tuple[bytes, str | None]]


class MediaRefused(Exception):
    def __init__(self, error: RequestError) -> None:
        self.error = error


def _refuse(part: MediaPart, why: str, code: ErrorCode = ErrorCode.INVALID_VALUE) -> MediaRefused:
    message = f"Invalid '{part.param}': {why}"
    return MediaRefused(RequestError(400, code.value, message, part.param))


@dataclass(frozen=True, slots=True)
class MediaReader:
    """Fills in the bytes of https and file parts (hashing them once, MediaPart.with_data)."""

    media_dir: Path | None = None  # None: file parts refused
    fetch_enabled: bool = True
    fetch: Fetch = HttpsFetch()

    @classmethod
    def from_settings(cls, settings: MediaSettings) -> MediaReader:
        return cls(
            media_dir=settings.media_dir,
            fetch_enabled=settings.fetch,
            fetch=HttpsFetch(allow_private=settings.fetch_private),
        )

    @staticmethod
    def unread(parts: tuple[MediaPart, ...]) -> bool:
        """Whether any part still needs reading (a fetch or a file: I/O, off the engine's
        thread)."""
        return any(p.data is None for p in parts)

    def resolve(
        self, parts: tuple[MediaPart, ...], cancel: Cancel | None = None
    ) -> tuple[MediaPart, ...]:
        """Every part with its bytes; raises MediaRefused with the line's 400 (Cancelled when
        `cancel` fired: the request is gone and gets no line from here)."""
        out = tuple(p if p.data is not None else self._read(p, cancel) for p in parts)
        try:
            check_total_bytes(out)
        except Reject as reject:
            raise MediaRefused(reject.error) from None
        return out

    def _read(self, part: MediaPart, cancel: Cancel | None) -> MediaPart:
        if part.source is MediaSource.FILE:
            return self._file(part)
        kind = part.kind.value
        if not self.fetch_enabled:
            raise _refuse(part, f"fetching https {kind}s is turned off here (${MEDIA_FETCH_ENV}); "
                          f"give the {kind} as a data: URL.")  # fmt: skip
        try:
            data, media_type = self.fetch(part.url, MAX_MEDIA_BYTES, cancel)
        except Cancelled:
            raise
        except TooLarge:
            raise _refuse(part, f"an image or video may be at most {MAX_MEDIA_BYTES} bytes.") \
                from None  # fmt: skip
        except FetchRefused as exc:  # its sentence never holds the server's body
            raise _refuse(part, f"the {kind} could not be fetched: {exc}; give the {kind} as a "
                          "data: URL.") from None  # fmt: skip
        except (OSError, ValueError) as exc:  # a fetch of another kind (tests)
            raise _refuse(part, f"the {kind} could not be fetched ({exc}); this machine may have "
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
