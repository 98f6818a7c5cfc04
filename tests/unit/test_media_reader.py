"""worker/media.py: https and file images read under bounds, or the line's 400; the bytes are
hashed once, when read."""

from __future__ import annotations

import urllib.error
from pathlib import Path

import pytest

from batchmlx.config import MEDIA_DIR_ENV, MEDIA_FETCH_ENV, load_media_settings
from batchmlx.formats import media as M
from batchmlx.formats.request import MediaKind, MediaPart, MediaSource, content_digest
from batchmlx.worker.media import MediaReader, MediaRefused


def from_env(env: dict[str, str]) -> MediaReader:
    return MediaReader.from_settings(load_media_settings(env))


def part(source: MediaSource, url: str) -> MediaPart:
    return MediaPart(MediaKind.IMAGE, source, "messages[0].content[0].image_url.url", 0, url)


def refused(reader: MediaReader, p: MediaPart) -> tuple[str, str, str | None]:
    with pytest.raises(MediaRefused) as info:
        reader.resolve((p,))
    e = info.value.error
    assert e.status_code == 400
    return e.code, e.message, e.param


def test_https_fetched_with_the_size_bound():
    calls = []

    def fetch(url, limit, cancel):
        calls.append((url, limit))
        return b"\x89PNG...", "image/png"

    (got,) = MediaReader(fetch=fetch).resolve((part(MediaSource.HTTPS, "https://x/a.png"),))
    assert calls == [("https://x/a.png", M.MAX_MEDIA_BYTES)]
    assert (got.data, got.media_type, got.digest) == (b"\x89PNG...", "image/png",
                                                     content_digest(got))  # fmt: skip
    big = MediaReader(fetch=lambda u, n, c: (b"\0" * (n + 1), None))
    code, message, param = refused(big, part(MediaSource.HTTPS, "https://x/a.png"))
    assert code == "invalid_value" and f"at most {M.MAX_MEDIA_BYTES} bytes" in message


def test_https_without_a_network_is_refused_saying_so():
    def offline(url, limit, cancel):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    code, message, param = refused(MediaReader(fetch=offline), part(MediaSource.HTTPS, "https://x"))
    assert param == "messages[0].content[0].image_url.url"
    assert "could not be fetched" in message and "name resolution" in message
    off = from_env({MEDIA_FETCH_ENV: "off"})
    assert not off.fetch_enabled
    assert "turned off" in refused(off, part(MediaSource.HTTPS, "https://x"))[1]


def test_files_only_inside_the_allowed_folder(tmp_path: Path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(b"img")
    (tmp_path / "secret.png").write_bytes(b"no")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    none = from_env({})
    code, message, _ = refused(none, part(MediaSource.FILE, str(allowed / "a.png")))
    assert code == "unsupported_value" and MEDIA_DIR_ENV in message
    reader = from_env({MEDIA_DIR_ENV: str(allowed)})
    (got,) = reader.resolve((part(MediaSource.FILE, str(allowed / "a.png")),))
    assert got.data == b"img" and got.digest is not None
    for outside in (tmp_path / "secret.png", allowed / "link.png", allowed / ".." / "secret.png"):
        assert "outside the allowed folder" in refused(reader, part(MediaSource.FILE,
                                                                    str(outside)))[1]  # fmt: skip
    assert "cannot be read" in refused(reader, part(MediaSource.FILE, str(allowed / "gone")))[1]


def test_the_request_total_counts_fetched_bytes():
    chunk = M.MAX_MEDIA_BYTES
    reader = MediaReader(fetch=lambda u, n, c: (b"\0" * chunk, None))
    parts = tuple(part(MediaSource.HTTPS, f"https://x/{i}") for i in range(3))
    with pytest.raises(MediaRefused) as info:
        reader.resolve(parts)
    assert f"at most {M.MAX_REQUEST_MEDIA_BYTES} bytes in all" in info.value.error.message


def test_the_media_switches_are_read_in_config():
    from batchmlx.config import MEDIA_FETCH_PRIVATE_ENV, MediaSettings, load_settings

    assert load_media_settings({}) == MediaSettings()  # https from global addresses, no files
    assert load_media_settings({MEDIA_FETCH_PRIVATE_ENV: "1"}).fetch_private
    assert not load_media_settings({MEDIA_FETCH_ENV: "no"}).fetch
    reader = from_env({MEDIA_FETCH_PRIVATE_ENV: "yes"})
    assert reader.fetch.allow_private  # type: ignore[attr-defined]
    assert not from_env({}).fetch.allow_private  # type: ignore[attr-defined]
    assert load_settings({MEDIA_FETCH_PRIVATE_ENV: "on"}).media.fetch_private
