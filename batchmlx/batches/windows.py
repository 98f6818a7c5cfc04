"""Completion windows: '24h' → seconds."""

from __future__ import annotations

import re

from batchmlx.batches.errors import BatchError

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
OPENAI_COMPLETION_WINDOW = "24h"  # the only window OpenAI's API accepts (and so ours)
MAX_WINDOW_S = 365 * 86400  # a longer window is a typo
# ASCII digits only: int() would also take "1_0" and "٣"
_WINDOW = re.compile(r"([0-9]{1,9})([smhd])")


def parse_window(window: str) -> int:
    """'24h' → 86400. OpenAI accepts only 24h; locally (the CLI, the inbox) any window of
    digits and one unit s/m/h/d, positive and at most a year, works."""
    match = _WINDOW.fullmatch(window)
    if match is None:
        raise BatchError(f"invalid completion window {window!r}; use e.g. 24h, 90m, 2d")
    seconds = int(match[1]) * WINDOW_UNITS[match[2]]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise BatchError(
            f"invalid completion window {window!r}: must be positive and at most "
            f"{MAX_WINDOW_S // 86400}d"
        )
    return seconds
