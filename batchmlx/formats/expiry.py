"""`expires_after` (files) and `output_expires_after` (batches): {anchor, seconds} → seconds.

OpenAI's bounds: anchor "created_at", 3600 (one hour) to 2592000 (30 days) seconds. Locally a
file without one never expires (nothing is deleted unless asked).
"""

from __future__ import annotations

from typing import Any

ANCHOR = "created_at"
MIN_EXPIRES_S = 3600
MAX_EXPIRES_S = 2_592_000


class ExpiresAfterError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_expires_after(value: Any, param: str) -> int | None:
    """Seconds after creation, or None when absent; raises ExpiresAfterError naming the param."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ExpiresAfterError(f"Invalid type for '{param}': expected an object.", param)
    anchor = value.get("anchor")
    if anchor != ANCHOR:
        raise ExpiresAfterError(
            f"Invalid value for '{param}.anchor': {anchor!r}. Supported values are: '{ANCHOR}'.",
            f"{param}.anchor",
        )
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.isdigit():  # multipart form fields are strings
        seconds = int(seconds)
    if not isinstance(seconds, int) or isinstance(seconds, bool):
        raise ExpiresAfterError(
            f"Invalid type for '{param}.seconds': expected an integer.", f"{param}.seconds"
        )
    if not MIN_EXPIRES_S <= seconds <= MAX_EXPIRES_S:
        raise ExpiresAfterError(
            f"Invalid '{param}.seconds': expected a value between {MIN_EXPIRES_S} and "
            f"{MAX_EXPIRES_S}, but got {seconds} instead.",
            f"{param}.seconds",
        )
    return seconds
