"""Which batch decodes a step carries while online work runs (issue 49, the inter-token tail).

A step's time grows with its rows: beside 8 online streams, a running batch of 256 made each
online token wait for a 256-row step. Beside online work (an online sequence runs or waits, or
ended moments ago: core/online_window.py), a step therefore feeds at most `limit` batch
decodes, the earliest admitted first (they finish first, so every batch sequence gets its turn:
no starvation), and online decodes always; the batch sequences left out keep their blocks and
decode again once online work ends or a turn frees.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchmlx.core.request import BATCH_PRIORITY
from batchmlx.core.sequence import Sequence


def is_urgent(seq: Sequence) -> bool:
    """More urgent than batch work (an online request)."""
    return seq.request.priority < BATCH_PRIORITY


@dataclass(slots=True)
class DecodeTurns:
    """The batch decodes a step may still take (None: no bound)."""

    left: int | None
    paused: int = 0  # batch decodes this step left out

    def takes(self, seq: Sequence) -> bool:
        """Whether decoding seq decodes this step (a turn is used)."""
        if self.left is None or is_urgent(seq):
            return True
        if self.left == 0:
            self.paused += 1
            return False
        self.left -= 1
        return True

    def decodes(self, decoding: Iterable[Sequence]) -> int:
        """How many of the decoding sequences `decoding` this step would feed (no turn used)."""
        urgent = batch = 0
        for s in decoding:
            if is_urgent(s):
                urgent += 1
            else:
                batch += 1
        return urgent + (batch if self.left is None else min(batch, self.left))
