"""Validate a batch input file the way the OpenAI Batch API does, before anything is enqueued.

The file either passes whole or fails whole: every error is counted, and the first
`MAX_REPORTED_ERRORS` (in line order) are reported with a last item giving the total, so a file of
garbage gives a small Batch object. `FileValidator` takes a file in chunks, a line at a time,
and keeps no line, so a 200 MB file is never whole. Only the shape is checked here; odd parameter
values (temperature 7, stream true, unknown keys) are per-request 400s decided at run time by
`formats.params`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from batchmlx.core.records import BatchErrorRecord
from batchmlx.formats.embeddings import (
    MAX_EMBEDDING_INPUTS,
    check_embeddings_input,
    count_inputs,
    too_many_inputs,
)
from batchmlx.formats.errors import ErrorCode, json_type
from batchmlx.formats.params import Endpoint, Role
from batchmlx.formats.responses import check_responses_input

SUPPORTED_URLS = tuple(Endpoint)
_ROLES = frozenset(Role)
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_content(content: Any, where: str) -> tuple[str, str] | None:
    """(param, problem) for a message content that is neither a string nor a list of parts."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return where, "must be a string or a non-empty array of content parts"
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(part, dict):
            return at, "must be an object"
        kind = part.get("type")
        if not isinstance(kind, str):
            return f"{at}.type", "must be a string"
        # Non-text parts (images, audio) are valid OpenAI input; they are refused per request.
        if kind == "text" and not isinstance(part.get("text"), str):
            return f"{at}.text", "must be a string"
    return None


def _check_chat(body: dict[str, Any]) -> tuple[str, str] | None:
    messages = body.get("messages")
    if messages is None:
        return "body.messages", "is required"
    if not isinstance(messages, list) or not messages:
        return "body.messages", "must be a non-empty array"
    for i, msg in enumerate(messages):
        at = f"body.messages[{i}]"
        if not isinstance(msg, dict):
            return at, "must be an object"
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            return f"{at}.role", f"must be one of {', '.join(sorted(_ROLES))}"
        content = msg.get("content")
        # An assistant turn that only calls tools has no content; tools are refused at run time.
        if (
            content is None
            and role == "assistant"
            and (msg.get("tool_calls") or msg.get("function_call"))
        ):
            continue
        if content is None:
            return f"{at}.content", "is required"
        problem = _check_content(content, f"{at}.content")
        if problem:
            return problem
    return None


def _check_prompt(body: dict[str, Any]) -> tuple[str, str] | None:
    prompt = body.get("prompt")
    if prompt is None:
        return "body.prompt", "is required"
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt:
        # One prompt per request is served; a longer list is refused at run time, not here.
        if all(isinstance(p, str) for p in prompt) or all(_is_int(t) for t in prompt):
            return None
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
            return None
    return "body.prompt", "must be a string, an array of strings or an array of token ids"


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
        model_override: str | None = None,
        max_tasks: int = MAX_TASKS,
        max_errors: int = MAX_REPORTED_ERRORS,
    ) -> None:
        self.model_override = model_override
        self.max_tasks = max_tasks
        self.errors = _Errors(max_errors)
        self.endpoint: str | None = None  # the one url of the file
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
        line_errors: list[BatchErrorRecord] = []
        try:
            obj = orjson.loads(raw)  # orjson refuses bad UTF-8 too; a trailing \r is whitespace
        except orjson.JSONDecodeError:
            obj = _NOT_JSON
        if not isinstance(obj, dict):
            self.errors.add(
                _err(
                    ErrorCode.INVALID_JSON_LINE,
                    f"Line {number} is not a valid JSON object.",
                    number,
                )
            )
            return None

        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            line_errors.append(
                _invalid(number, "custom_id", "'custom_id' must be a non-empty string.")
            )
        elif custom_id in self._seen_ids:
            line_errors.append(
                _err(
                    ErrorCode.DUPLICATE_CUSTOM_ID,
                    f"Line {number}: custom_id {custom_id!r} is already used on line "
                    f"{self._seen_ids[custom_id]}; each request in a batch needs a unique "
                    "custom_id.",
                    number,
                    "custom_id",
                )
            )
        else:
            self._seen_ids[custom_id] = number

        method = obj.get("method")
        if method != "POST":
            shown = "missing" if "method" not in obj else repr(method)
            line_errors.append(_invalid(number, "method", f"'method' must be \"POST\" ({shown})."))

        url = obj.get("url")
        if not isinstance(url, str):
            line_errors.append(
                _invalid(number, "url", f"'url' must be a string, not {json_type(url)}.")
                if "url" in obj
                else _invalid(number, "url", "'url' is required.")
            )
            url = None
        elif url not in SUPPORTED_URLS:
            line_errors.append(
                _err(
                    ErrorCode.INVALID_URL,
                    f"Line {number}: the url {url!r} is not supported. "
                    f"Supported urls are: {', '.join(SUPPORTED_URLS)}.",
                    number,
                    "url",
                )
            )
            url = None
        elif self.endpoint is None:
            self.endpoint = url
        elif url != self.endpoint:
            line_errors.append(
                _err(
                    ErrorCode.URL_MISMATCH,
                    f"Line {number}: the url {url!r} differs from {self.endpoint!r}, the url of "
                    "the first request; every request in a batch must use the same url.",
                    number,
                    "url",
                )
            )

        body = obj.get("body")
        if not isinstance(body, dict):
            what = (
                "is required" if "body" not in obj else f"must be an object, not {json_type(body)}"
            )
            line_errors.append(_invalid(number, "body", f"'body' {what}."))
        else:
            if self.model_override is None:
                body_model = body.get("model")
                if not isinstance(body_model, str) or not body_model:
                    line_errors.append(
                        _invalid(number, "body.model", "'body.model' must be a non-empty string.")
                    )
                elif self.model is None:
                    self.model, self._model_line = body_model, number
                elif body_model != self.model:
                    line_errors.append(
                        _err(
                            ErrorCode.MODEL_MISMATCH,
                            f"Line {number}: the model {body_model!r} differs from "
                            f"{self.model!r}, the model of the first request; every request "
                            "in a batch must use the same model.",
                            number,
                            "body.model",
                        )
                    )
            if url is not None:
                problem = _CHECKS[Endpoint(url)](body)
                if problem is None and url == Endpoint.EMBEDDINGS:
                    self._embedding_inputs += count_inputs(body["input"])
                if problem:
                    param, what = problem
                    line_errors.append(_invalid(number, param, f"'{param}' {what}."))

        for key in obj:
            if key not in _ENVELOPE_KEYS:
                line_errors.append(
                    _invalid(
                        number,
                        key,
                        f"unexpected key {key!r}; a request has exactly "
                        "custom_id, method, url and body.",
                    )
                )

        kept = None
        if not line_errors:
            # no error on the line: each field passed its check above
            assert isinstance(custom_id, str) and url is not None and isinstance(body, dict)
            try:  # orjson reads JSON nested 1024 deep but writes at most 254: refuse it here
                kept = BatchLine(number, custom_id, url, orjson.dumps(body).decode())
            except orjson.JSONEncodeError:
                line_errors.append(
                    _err(
                        ErrorCode.INVALID_JSON_LINE,
                        f"Line {number}: 'body' is nested too deeply to be stored "
                        f"(at most {MAX_NESTING} levels).",
                        number,
                        "body",
                    )
                )
        for err in line_errors:
            self.errors.add(err)
        return kept


    def finish(
        self, *, model_resolves: Callable[[str], bool] | None = None
    ) -> ValidationResult:
        """The file-level checks after its last line, and the result (no lines in it).
        `model_resolves`, when given, is asked once about the file's model."""
        errors = self.errors
        if self.tasks == 0:
            errors.add(
                _err(ErrorCode.EMPTY_FILE, "The batch input file has no requests."), keep=True
            )
        if self._embedding_inputs > MAX_EMBEDDING_INPUTS:
            errors.add(too_many_inputs(self._embedding_inputs), keep=True)
        if (
            self.model_override is None
            and self.model is not None
            and model_resolves is not None
            and not model_resolves(self.model)
        ):
            errors.add(
                _err(
                    ErrorCode.MODEL_NOT_FOUND,
                    f"The model {self.model!r} does not exist or could not be loaded.",
                    self._model_line,
                    "body.model",
                ),
                keep=True,
            )
        return ValidationResult((), errors.final(), self.endpoint, self.model, errors.total)


def too_large(size: int, max_bytes: int = MAX_FILE_BYTES) -> ValidationResult | None:
    """The result of a file over `max_bytes` (None: within it), known from its size alone."""
    if size <= max_bytes:
        return None
    msg = f"The batch input file is {size} bytes; the limit is {max_bytes} bytes."
    return ValidationResult((), (_err(ErrorCode.FILE_TOO_LARGE, msg),), None, None, 1)


def validate_batch_file(
    data: bytes,
    *,
    model_resolves: Callable[[str], bool] | None = None,
    model_override: str | None = None,
    max_bytes: int = MAX_FILE_BYTES,
    max_tasks: int = MAX_TASKS,
    max_errors: int = MAX_REPORTED_ERRORS,
) -> ValidationResult:
    """Check every line of a whole batch input file; O(n) in its size.

    With `model_override` the body models are ignored (a file written for "gpt-4o-mini" runs
    unchanged) and the result's `model` is the override. Otherwise `model_resolves`, when given,
    is asked once about the file's model.
    """
    over = too_large(len(data), max_bytes)
    if over is not None:
        return over
    v = FileValidator(model_override=model_override, max_tasks=max_tasks, max_errors=max_errors)
    # a BOM is skipped by starting after it, not by copying the file without it
    lines = _split_lines(data, len(_BOM) if data.startswith(_BOM) else 0)
    good = [line for number, raw in lines if (line := v.check(number, raw)) is not None]
    result = v.finish(model_resolves=model_resolves)
    return ValidationResult(
        tuple(good), result.errors, result.endpoint, result.model, result.error_count
    )


_NOT_JSON = object()  # a sentinel no JSON value can equal
_CHECKS = {
    Endpoint.CHAT: _check_chat,
    Endpoint.COMPLETIONS: _check_prompt,
    Endpoint.RESPONSES: check_responses_input,
    Endpoint.EMBEDDINGS: check_embeddings_input,
}
