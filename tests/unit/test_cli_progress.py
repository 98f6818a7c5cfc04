"""`submit --wait`'s progress display (cli/progress.py): rich's bar on a terminal, plain lines
otherwise, both with tokens/s and an ETA."""

from __future__ import annotations

import asyncio
import io
import re
import sys
import time

from rich.console import Console

from batchmlx.cli.progress import ProgressView
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchRecord, BatchUsage, RequestCounts


class Store:
    """Answers get_batch with the next record of a script (the last one repeats)."""

    def __init__(self, records: list[BatchRecord]) -> None:
        self.records = records

    async def get_batch(self, batch_id: str) -> BatchRecord:
        return self.records.pop(0) if len(self.records) > 1 else self.records[0]


def rec(status: BatchStatus, done: int, tokens: int, started: int) -> BatchRecord:
    return BatchRecord(
        id="batch_p", endpoint="/v1/completions", model="m", input_file_id="f",
        completion_window="24h", status=status, created_at=started, in_progress_at=started,
        work_started_at=float(started),
        request_counts=RequestCounts(total=10, completed=done),
        usage=BatchUsage(output_tokens=tokens),
    )  # fmt: skip


def script() -> list[BatchRecord]:
    started = int(time.time()) - 20  # 20 s ago: about 25 tok/s, 0.25 request/s
    return [
        rec(BatchStatus.IN_PROGRESS, 5, 500, started),
        rec(BatchStatus.COMPLETED, 10, 1000, started),
    ]


def run(view: ProgressView) -> None:
    async def main() -> None:
        await view.show()
        await view.show(final=True)

    asyncio.run(main())


def test_plain_lines_when_stdout_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())  # not a terminal
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)  # stderr is one: no matter
    view = ProgressView(Store(script()), "batch_p", False, console=console)
    assert view.live is False
    run(view)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert re.fullmatch(r"batch_p in_progress 5/10 \(50%\)  2\d\.\d tok/s  ETA \d+s  \d+s",
                        lines[0]), lines[0]  # fmt: skip
    assert re.fullmatch(r"batch_p completed 10/10 \(100%\)  \d\d\.\d tok/s  ETA n/a  \d+s",
                        lines[1]), lines[1]  # fmt: skip


def test_a_rich_bar_on_a_terminal():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    view = ProgressView(Store(script()), "batch_p", False, console=console, live=True)
    run(view)
    text = out.getvalue()
    assert "━" in text  # rich's bar
    assert re.search(r"in_progress\s.*5/10\s+2\d\.\d tok/s ETA \d+s", text), text
    assert re.search(r"completed\s.*10/10\s+\d\d\.\d tok/s ETA n/a", text), text


def test_quiet_prints_nothing():
    out = io.StringIO()
    view = ProgressView(Store(script()), "batch_p", True, console=Console(file=out), live=False)
    run(view)
    assert out.getvalue() == ""
