"""Whether a step is taken beside online work (issue 49): while online requests run or wait,
and for `linger_s` after the last one, a step keeps the bounds it takes beside online work (the
batch prompt tokens, the batch decode turns, the batch admissions).

Why the linger: an online client's next request usually comes within moments (a chat's next
turn, a stream's next request). Traced with one stream over a 256-chat batch: as soon as an
online request ended, the batch was admitted up to its full width and the next step fed 256
batch prompt tokens beside 30-40 decodes; the stream's next request, sent at once, waited
about 500 ms for that step to end (its own step then took about 200).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class OnlineWindow:
    linger_s: float  # the bounds hold this long after online work ended (0: not at all)
    clock: Callable[[], float]  # the scheduler's (seconds)
    until: float = field(default=-math.inf)  # the bounds hold before this time

    def step(self, online: bool) -> bool:
        """Whether this step keeps the bounds; `online`: online work runs or waits now."""
        now = self.clock()
        if online:
            self.until = now + self.linger_s
            return True
        return now < self.until
