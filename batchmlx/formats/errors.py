"""Every error code batchmlx speaks, in one place, and OpenAI's `errors` list object."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from batchmlx.core.records import BatchErrorRecord

# A file-level validation error is the record the store keeps; no second type for it.
BatchError = BatchErrorRecord


class ErrorCode(enum.StrEnum):
    # input file validation (the batch fails, nothing is enqueued)
    INVALID_JSON_LINE = "invalid_json_line"
    INVALID_REQUEST = "invalid_request"
    DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
    MODEL_MISMATCH = "model_mismatch"
    EMPTY_FILE = "empty_file"
    TOO_MANY_TASKS = "too_many_tasks"
    FILE_TOO_LARGE = "file_too_large"
    MODEL_NOT_FOUND = "model_not_found"
    INVALID_URL = "invalid_url"  # not the batch's endpoint, or one batchmlx does not serve
    STREAMING_UNSUPPORTED = "streaming_unsupported"  # `stream: true` on a line
    TOO_MANY_EMBEDDING_INPUTS = "too_many_embedding_inputs"  # over 50,000 across one batch
    TOO_MANY_ERRORS = "too_many_errors"  # the last item of a cut list: how many in all
    # an inbox file that cannot be taken (a symlink, a name not UTF-8, unreadable)
    FILE_REFUSED = "file_refused"
    # line-level errors of the error file (the request never ran)
    BATCH_EXPIRED = "batch_expired"
    BATCH_CANCELLED = "batch_cancelled"
    # per-request 400 bodies
    INVALID_VALUE = "invalid_value"
    INVALID_TYPE = "invalid_type"
    UNSUPPORTED_VALUE = "unsupported_value"
    UNKNOWN_PARAMETER = "unknown_parameter"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MAX_TOKENS_PER_REQUEST = "max_tokens_per_request"  # embeddings: over 300,000 tokens in all


def error_dict(err: BatchErrorRecord) -> dict[str, Any]:
    return {"code": err.code, "message": err.message, "param": err.param, "line": err.line}


def errors_object(errors: Iterable[BatchErrorRecord]) -> dict[str, Any]:
    """OpenAI's `Batch.errors`: {"object": "list", "data": [...]}."""
    return {"object": "list", "data": [error_dict(e) for e in errors]}


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, as error messages name it: "an integer", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
