"""Validate a batch input file the way the OpenAI Batch API does, before anything is enqueued.

The file either passes whole or fails whole: every error is counted, and the first
`MAX_REPORTED_ERRORS` (in line order) are reported with a last item giving the total, so a file of
garbage gives a small Batch object. `FileValidator` takes a file in chunks, a line at a time,
and keeps no line, so a 200 MB file is never whole. As OpenAI does (docs/validation.md), what
fails the file is what keeps a line from being a request of this batch: not JSON, an envelope
key missing or mistyped, a url other than the batch's endpoint, `stream: true`, the model, the
endpoint's input field missing or of the wrong type. What is inside a well-formed request (the
messages' roles and contents, parameter values, unknown keys) is that line's own 400, decided at
run time by `formats.params`. Each endpoint's body check is its module's (`chat.check_chat`,
...), next to the run-time parser that judges the same body.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from batchmlx.core.model_rule import Chosen, Refused
from batchmlx.core.records import BatchErrorRecord
from batchmlx.formats.chat import check_chat
from batchmlx.formats.completions import check_prompt
from batchmlx.formats.embeddings import (
    MAX_EMBEDDING_INPUTS,
    check_embeddings_input,
    count_inputs,
    too_many_inputs,
)
from batchmlx.formats.errors import ErrorCode, json_type
from batchmlx.formats.fields import REQUIRED
from batchmlx.formats.request import Endpoint
from batchmlx.formats.responses import check_responses_input

SUPPORTED_URLS = tuple(Endpoint)
MAX_FILE_BYTES = 200 * 1024 * 1024
MAX_TASKS = 50_000
MAX_REPORTED_ERRORS = 100  # errors listed on a failed batch; the rest are only counted

_ENVELOPE_KEYS = ("custom_id", "method", "url", "body")
MAX_NESTING = 254  # the deepest body orjson writes (the store writes bodies with orjson)
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int  # 1-based, counting every input line (blank ones too)
    custom_id: str
    url: str
    # the body as orjson writes it: proven storable, smaller than a dict; text, because orjson's
    # bytes keep their whole write buffer allocated (about 64 KB each, whatever their length)
    body_json: str

    @property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.body_json)


@dataclass(frozen=True, slots=True)
class ValidationResult:
    lines: tuple[BatchLine, ...]  # the lines without errors (all of them when ok)
    # in line order, file-level errors (line None) first; at most MAX_REPORTED_ERRORS of them,
    # then one `too_many_errors` item saying how many there were in all
    errors: tuple[BatchErrorRecord, ...]
    endpoint: str | None  # the one url of the file
    model: str | None  # the one body model of the file; the override when one is given
    error_count: int = 0  # every error found, listed or not

    @property
    def ok(self) -> bool:
        return not self.errors and bool(self.lines)


def _err(
    code: ErrorCode, message: str, line: int | None = None, param: str | None = None
) -> BatchErrorRecord:
    return BatchErrorRecord(code=code.value, message=message, line=line, param=param)


def _invalid(line: int, param: str, message: str) -> BatchErrorRecord:
    return _err(ErrorCode.INVALID_REQUEST, f"Line {line}: {message}", line, param)


def _missing(line: int, key: str) -> BatchErrorRecord:
    """An envelope key absent (or null), in OpenAI's words."""
    return _err(
        ErrorCode.MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{key}'.", line, key
    )


# OpenAI's name of each endpoint in its `streaming_unsupported` message; embeddings have no
# `stream` parameter (it is an unknown key there, that line's 400)
_STREAMING_NAMES = {
    Endpoint.CHAT: "Chat Completions",
    Endpoint.COMPLETIONS: "Completions",
    Endpoint.RESPONSES: "Responses",
}


def _split_lines(data: bytes, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(1-based number, line) one at a time: no list of every line of a 200 MB file."""
    number, end = 1, len(data)
    while start <= end:
        stop = data.find(b"\n", start)
        if stop < 0:
            stop = end
        yield number, data[start:stop]
        start, number = stop + 1, number + 1


class _Errors:
    """The first `limit` errors in the order found, and a count of all of them."""

    __slots__ = ("kept", "limit", "total")

    def __init__(self, limit: int) -> None:
        self.kept: list[BatchErrorRecord] = []
        self.limit = limit
        self.total = 0

    def add(self, err: BatchErrorRecord, *, keep: bool = False) -> None:
        """`keep`: listed even past the limit (file-level errors found last, sorted first)."""
        self.total += 1
        if keep or len(self.kept) < self.limit:
            self.kept.append(err)

    def final(self) -> tuple[BatchErrorRecord, ...]:
        # stable: file-level errors first, then by line, each line's errors in the order found
        kept = sorted(self.kept, key=lambda e: e.line or 0)[: self.limit]
        if self.total > len(kept):
            kept.append(
                _err(
                    ErrorCode.TOO_MANY_ERRORS,
                    f"... and {self.total - len(kept):,} more errors ({self.total:,} in all); "
                    f"only the first {len(kept)} are listed.",
                )
            )
        return tuple(kept)


class LineSplitter:
    """A file given in chunks, cut into (1-based number, line) as `_split_lines` cuts the whole
    file, a UTF-8 BOM at its start skipped; it holds one partial line between chunks."""

    __slots__ = ("_first", "_number", "_tail")

    def __init__(self) -> None:
        self._number, self._tail, self._first = 1, b"", True

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        """The lines `chunk` completes."""
        if not chunk:
            return []
        pieces = (self._tail + chunk).split(b"\n")
        self._tail = pieces.pop()
        return [self._line(p) for p in pieces]

    def end(self) -> list[tuple[int, bytes]]:
        """The last line (empty after a final newline, as `_split_lines` gives it)."""
        tail, self._tail = self._tail, b""
        return [self._line(tail)]

    def _line(self, piece: bytes) -> tuple[int, bytes]:
        if self._first:
            piece, self._first = piece.removeprefix(_BOM), False
        self._number += 1
        return self._number - 1, piece


class FileValidator:
    """Validates a file line by line (`check`), keeping no line: what `validate_batch_file`
    does to a whole file, for files fed in chunks (a 200 MB file is never whole). Holds the
    custom ids seen (at most MAX_TASKS) and the first errors."""

    def __init__(
        self,
        *,
        endpoint: str | None = None,
        model_override: str | None = None,
        max_tasks: int = MAX_TASKS,
        max_errors: int = MAX_REPORTED_ERRORS,
    ) -> None:
        """`endpoint`: the batch's (HTTP names it); None: the first line's url (CLI, inbox)."""
        self.model_override = model_override
        self.max_tasks = max_tasks
        self.errors = _Errors(max_errors)
        self.endpoint: str | None = endpoint  # the one url of the file
        self.model: str | None = model_override
        self.tasks = 0
        self._seen_ids: dict[str, int] = {}
        self._model_line: int | None = None
        self._embedding_inputs = 0

    @property
    def failed(self) -> bool:
        """An error was found: the file fails whole, so its good lines need not be kept."""
        return self.errors.total > 0

    def check_lines(self, lines: Iterable[tuple[int, bytes]]) -> list[BatchLine]:
        """`check` each line; the good ones (none once the file has failed)."""
        good = []
        for number, raw in lines:
            line = self.check(number, raw)
            if line is not None and not self.failed:
                good.append(line)
        return [] if self.failed else good

    def check(self, number: int, raw: bytes) -> BatchLine | None:
        """Check one line; the line (its body re-encoded) when it has no error."""
        if not raw.strip():
            return None  # blank lines (and the empty tail after the final newline) still count
        self._count(number)
        obj = _json_object(raw)
        if obj is None:
            self.errors.add(
                _err(ErrorCode.INVALID_JSON_LINE, f"Line {number} is not a valid JSON object.",
                     number)
            )  # fmt: skip
            return None
        errs: list[BatchErrorRecord] = []  # this line's, in the order found
        custom_id = self._custom_id(number, obj, errs)
        _check_method(number, obj, errs)
        url = self._url(number, obj, errs)
        body = self._body(number, obj, url, errs)
        errs.extend(_stray_keys(number, obj))
        kept = None
        if not errs:
            # no error on the line: each field passed its check above
            assert custom_id is not None and url is not None and body is not None
            kept = _stored(number, custom_id, url, body, errs)
        for err in errs:
            self.errors.add(err)
        return kept

    def _count(self, number: int) -> None:
        self.tasks += 1
        if self.tasks == self.max_tasks + 1:
            self.errors.add(
                _err(
                    ErrorCode.TOO_MANY_TASKS,
                    f"The batch input file has more than {self.max_tasks} requests; "
                    f"line {number} is request {self.tasks}.",
                    number,
                )
            )

    def _custom_id(
        self, number: int, obj: dict[str, Any], errs: list[BatchErrorRecord]
    ) -> str | None:
        custom_id = obj.get("custom_id")
        if custom_id is None:
            errs.append(_missing(number, "custom_id"))
            return None
        if not isinstance(custom_id, str) or not custom_id:
            errs.append(_invalid(number, "custom_id", "'custom_id' must be a non-empty string."))
            return None
        if custom_id in self._seen_ids:
            errs.append(
                _err(
                    ErrorCode.DUPLICATE_CUSTOM_ID,
                    f"Line {number}: custom_id {custom_id!r} is already used on line "
                    f"{self._seen_ids[custom_id]}; each request in a batch needs a unique "
                    "custom_id.",
                    number,
                    "custom_id",
                )
            )
            return None
        self._seen_ids[custom_id] = number
        return custom_id

    def _url(self, number: int, obj: dict[str, Any], errs: list[BatchErrorRecord]) -> str | None:
        """The line's url; None when it is not the batch's endpoint (nor one batchmlx serves):
        its body is then not checked, as OpenAI reports only the url."""
        url = obj.get("url")
        if url is None:
            errs.append(_missing(number, "url"))
            return None
        if not isinstance(url, str):
            errs.append(_invalid(number, "url", f"'url' must be a string, not {json_type(url)}."))
            return None
        if self.endpoint is not None and url != self.endpoint:
            errs.append(
                _err(
                    ErrorCode.INVALID_URL,
                    "The URL provided for this request does not match the batch endpoint.",
                    number,
                    "url",
                )
            )
            return None
        if url not in SUPPORTED_URLS:
            errs.append(
                _err(
                    ErrorCode.INVALID_URL,
                    f"Line {number}: the url {url!r} is not supported. "
                    f"Supported urls are: {', '.join(SUPPORTED_URLS)}.",
                    number,
                    "url",
                )
            )
            return None
        self.endpoint = url  # the first good url is the batch's when it named none
        return url

    def _body(
        self, number: int, obj: dict[str, Any], url: str | None, errs: list[BatchErrorRecord]
    ) -> dict[str, Any] | None:
        """The line's body, its model and its endpoint's shape checked; None if not an object."""
        body = obj.get("body")
        if body is None:
            errs.append(_missing(number, "body"))
            return None
        if not isinstance(body, dict):
            what = f"'body' must be an object, not {json_type(body)}."
            errs.append(_invalid(number, "body", what))
            return None
        self._model(number, body, errs)
        _check_stream(number, url, body, errs)
        self._body_shape(number, url, body, errs)
        return body

    def _model(self, number: int, body: dict[str, Any], errs: list[BatchErrorRecord]) -> None:
        if self.model_override is not None:
            return
        body_model = body.get("model")
        if not isinstance(body_model, str) or not body_model:
            errs.append(_invalid(number, "body.model", "'body.model' must be a non-empty string."))
        elif self.model is None:
            self.model, self._model_line = body_model, number
        elif body_model != self.model:
            errs.append(
                _err(
                    ErrorCode.MODEL_MISMATCH,
                    f"Line {number}: the model {body_model!r} differs from {self.model!r}, the "
                    "model of the first request; every request in a batch must use the same "
                    "model.",
                    number,
                    "body.model",
                )
            )

    def _body_shape(
        self, number: int, url: str | None, body: dict[str, Any], errs: list[BatchErrorRecord]
    ) -> None:
        """The endpoint's shape check of the body (its module's `check_*`)."""
        if url is None:
            return
        problem = _CHECKS[Endpoint(url)](body)
        if problem is None:
            if url == Endpoint.EMBEDDINGS:
                self._embedding_inputs += count_inputs(body["input"])
            return
        param, what = problem
        if what == REQUIRED:  # OpenAI's words: "Messages parameter is required."
            name = param.removeprefix("body.").capitalize()
            errs.append(_err(ErrorCode.INVALID_REQUEST, f"{name} parameter is required.",
                             number, param))  # fmt: skip
        else:
            errs.append(_invalid(number, param, f"'{param}' {what}."))

    def finish(
        self, *, model_choice: Callable[[str], Chosen | Refused] | None = None
    ) -> ValidationResult:
        """The file-level checks after its last line, and the result (no lines in it).
        `model_choice`, when given, is asked once about the file's model (core/model_rule.py):
        the result's `model` is the model it chose."""
        errors = self.errors
        if self.tasks == 0:
            errors.add(
                _err(ErrorCode.EMPTY_FILE, "The batch input file has no requests."), keep=True
            )
        if self._embedding_inputs > MAX_EMBEDDING_INPUTS:
            errors.add(too_many_inputs(self._embedding_inputs), keep=True)
        choice = None
        if self.model_override is None and self.model is not None and model_choice is not None:
            choice = model_choice(self.model)
        if isinstance(choice, Refused):
            errors.add(
                _err(ErrorCode.MODEL_NOT_FOUND, choice.message, self._model_line, "body.model"),
                keep=True,
            )
        elif choice is not None:
            self.model = choice.model
        return ValidationResult((), errors.final(), self.endpoint, self.model, errors.total)


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(raw)  # orjson refuses bad UTF-8 too; a trailing \r is whitespace
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _check_method(number: int, obj: dict[str, Any], errs: list[BatchErrorRecord]) -> None:
    method = obj.get("method")
    if method is None:
        errs.append(_missing(number, "method"))
    elif method != "POST":
        errs.append(_invalid(number, "method", f"'method' must be \"POST\" ({method!r})."))


def _check_stream(
    number: int, url: str | None, body: dict[str, Any], errs: list[BatchErrorRecord]
) -> None:
    """A batch cannot stream: OpenAI fails the file, naming the line (not a per-line 400)."""
    name = _STREAMING_NAMES.get(Endpoint(url)) if url is not None else None
    if name is not None and body.get("stream") is True:
        errs.append(
            _err(
                ErrorCode.STREAMING_UNSUPPORTED,
                f"{name}: Streaming is not supported in the Batch API.",
                number,
                "body.stream",
            )
        )


def _stray_keys(number: int, obj: dict[str, Any]) -> list[BatchErrorRecord]:
    return [
        _invalid(
            number,
            key,
            f"unexpected key {key!r}; a request has exactly custom_id, method, url and body.",
        )
        for key in obj
        if key not in _ENVELOPE_KEYS
    ]


def _stored(
    number: int, custom_id: str, url: str, body: dict[str, Any], errs: list[BatchErrorRecord]
) -> BatchLine | None:
    """The line as kept, its body written by orjson; None (and an error) if it cannot be."""
    try:  # orjson reads JSON nested 1024 deep but writes at most 254: refuse it here
        return BatchLine(number, custom_id, url, orjson.dumps(body).decode())
    except orjson.JSONEncodeError:
        errs.append(
            _err(
                ErrorCode.INVALID_JSON_LINE,
                f"Line {number}: 'body' is nested too deeply to be stored "
                f"(at most {MAX_NESTING} levels).",
                number,
                "body",
            )
        )
        return None


def too_large(size: int, max_bytes: int = MAX_FILE_BYTES) -> ValidationResult | None:
    """The result of a file over `max_bytes` (None: within it), known from its size alone."""
    if size <= max_bytes:
        return None
    msg = f"The batch input file is {size} bytes; the limit is {max_bytes} bytes."
    return ValidationResult((), (_err(ErrorCode.FILE_TOO_LARGE, msg),), None, None, 1)


def validate_batch_file(
    data: bytes,
    *,
    endpoint: str | None = None,
    model_choice: Callable[[str], Chosen | Refused] | None = None,
    model_override: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
    max_tasks: int = MAX_TASKS,
    max_errors: int = MAX_REPORTED_ERRORS,
) -> ValidationResult:
    """Check every line of a whole batch input file; O(n) in its size.

    `endpoint`: the batch's; None: the first line's url. With `model_override` the body models
    are ignored (a file written for "gpt-4o-mini" runs unchanged) and the result's `model` is
    the override. Otherwise `model_choice`, when given, is asked once about the file's model.
    """
    over = too_large(len(data), max_bytes)
    if over is not None:
        return over
    v = FileValidator(
        endpoint=endpoint, model_override=model_override, max_tasks=max_tasks,
        max_errors=max_errors,
    )  # fmt: skip
    # a BOM is skipped by starting after it, not by copying the file without it
    lines = _split_lines(data, len(_BOM) if data.startswith(_BOM) else 0)
    good = [line for number, raw in lines if (line := v.check(number, raw)) is not None]
    result = v.finish(model_choice=model_choice)
    return ValidationResult(
        tuple(good), result.errors, result.endpoint, result.model, result.error_count
    )


_CHECKS = {
    Endpoint.CHAT: check_chat,
    Endpoint.COMPLETIONS: check_prompt,
    Endpoint.RESPONSES: check_responses_input,
    Endpoint.EMBEDDINGS: check_embeddings_input,
}
