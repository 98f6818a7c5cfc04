"""formats/output and formats/chunks: what finalize writes and what a stream sends, pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from batchmlx.core.lifecycle import RequestStatus
from batchmlx.formats.chunks import StreamChunks
from batchmlx.formats.output import render_results
from batchmlx.formats.request import Endpoint


@dataclass
class Row:
    custom_id: str
    status: RequestStatus
    status_code: int | None
    response_body: dict[str, Any] | None
    error: dict[str, Any] | None
    cache_outcome: str | None


def _rows() -> list[Row]:
    return [
        Row("a", RequestStatus.SUCCEEDED, 200, {"object": "chat.completion"}, None, "MISS"),
        Row("b", RequestStatus.FAILED, 400, {"error": {"message": "bad"}}, None, None),
        Row("c", RequestStatus.FAILED, 0, None, {"code": "batch_expired", "message": "x"}, "HIT"),
    ]


def test_render_is_deterministic_and_sorts_lines_into_output_and_errors() -> None:
    first, again = render_results("batch_x", _rows()), render_results("batch_x", _rows())
    assert (first.output, first.errors) == (again.output, again.errors)  # ids are derived
    out = [orjson.loads(x) for x in first.output.splitlines()]
    err = [orjson.loads(x) for x in first.errors.splitlines()]
    assert [x["custom_id"] for x in out] == ["a"]
    assert out[0]["response"]["status_code"] == 200
    assert [x["custom_id"] for x in err] == ["b", "c"]
    assert err[0]["response"]["status_code"] == 400 and err[0]["error"] is None
    assert err[1]["response"] is None and err[1]["error"]["code"] == "batch_expired"
    assert first.outcomes == {"hits": 1, "prefix_hits": 0, "misses": 1}
    assert render_results("batch_y", _rows()).output != first.output  # another batch's ids


def test_stream_chunks_share_one_id_and_created() -> None:
    chunks = StreamChunks(Endpoint.CHAT, "m", created=123)
    first, last = chunks.text(0, "hi", role=True), chunks.text(0, "", finish="stop")
    assert first["id"] == last["id"] and first["created"] == last["created"] == 123
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"
    assert chunks.usage({"total_tokens": 3})["choices"] == []
    legacy = StreamChunks(Endpoint.COMPLETIONS, "m", created=1).text(0, "x")
    assert legacy["object"] == "text_completion" and legacy["choices"][0]["text"] == "x"
