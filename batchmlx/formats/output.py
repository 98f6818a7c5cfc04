"""A batch's output and error files, rendered from its done requests: pure, so finalizing
again after a crash renders the same bytes (every id in them is derived, none random)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from batchmlx.core.lifecycle import RequestStatus
from batchmlx.formats.openai import IdPrefix, dumps_line, error_line, output_line

_OUTCOME_KEYS = {"HIT": "hits", "PREFIX_HIT": "prefix_hits", "MISS": "misses"}


class DoneRequest(Protocol):
    """What rendering reads of a done request (the store's ResultRow has it)."""

    @property
    def custom_id(self) -> str: ...
    @property
    def status(self) -> RequestStatus: ...
    @property
    def status_code(self) -> int | None: ...
    @property
    def response_body(self) -> dict[str, Any] | None: ...
    @property
    def error(self) -> dict[str, Any] | None: ...
    @property
    def cache_outcome(self) -> str | None: ...


@dataclass(slots=True)
class RenderedFiles:
    output: bytes  # the output file (succeeded requests)
    errors: bytes  # the error file (failed ones)
    outcomes: dict[str, int] = field(default_factory=dict)  # prefix-cache hits, prefix_hits, misses
    # the model actually used, as the first succeeded response body names it (None: none did)
    served_model: str | None = None


def derived_id(batch_id: str, key: str, prefix: str) -> str:
    """An id derived from the batch and a key, not random: rendering twice gives the same."""
    digest = hashlib.sha256(f"{batch_id}\0{key}".encode()).hexdigest()[:24]
    return f"{prefix}{digest}"


class ResultRenderer:
    """Renders done requests one at a time (finalize streams a batch's rows through it), and
    counts what the Batch's stats say: prefix-cache outcomes and the model actually used."""

    __slots__ = ("batch_id", "outcomes", "served_model")

    def __init__(self, batch_id: str) -> None:
        self.batch_id = batch_id
        self.outcomes = {"hits": 0, "prefix_hits": 0, "misses": 0}
        # the model the first succeeded body (in line order) names
        self.served_model: str | None = None

    @staticmethod
    def to_output(row: DoneRequest) -> bool:
        """Whether the row's line goes to the output file (else the error file); the store
        selects the same rows for each file (`Store.stream_results`)."""
        return row.status is RequestStatus.SUCCEEDED and row.response_body is not None

    def render(self, row: DoneRequest) -> bytes:
        """The row's JSONL line, for the file `to_output` says."""
        if row.cache_outcome in _OUTCOME_KEYS:
            self.outcomes[_OUTCOME_KEYS[row.cache_outcome]] += 1
        line_id = derived_id(self.batch_id, row.custom_id, IdPrefix.BATCH_REQUEST)
        if row.response_body is None:
            e = row.error or {"code": "server_error", "message": "no result"}
            return dumps_line(
                error_line(id=line_id, custom_id=row.custom_id, code=e["code"],
                           message=e["message"])
            )  # fmt: skip
        line = output_line(
            id=line_id,
            custom_id=row.custom_id,
            status_code=row.status_code or 200,
            request_id=derived_id(self.batch_id, row.custom_id, "req_"),
            body=row.response_body,
        )
        if self.served_model is None and row.status is RequestStatus.SUCCEEDED:
            model = row.response_body.get("model")
            self.served_model = model if isinstance(model, str) else None
        return dumps_line(line)


def render_results(batch_id: str, rows: Iterable[DoneRequest]) -> RenderedFiles:
    """The JSONL output and error files of a batch, lines in the order of `rows` (whole, for
    small batches and tests; finalize streams through `ResultRenderer`)."""
    out, err = bytearray(), bytearray()
    r = ResultRenderer(batch_id)
    for row in rows:
        (out if r.to_output(row) else err).extend(r.render(row))
    return RenderedFiles(bytes(out), bytes(err), r.outcomes, r.served_model)
