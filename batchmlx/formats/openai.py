"""OpenAI wire objects, field for field: ids, the completion envelope and choice results the
endpoint modules (chat, completions, responses) render into, batch output/error lines, the Batch,
file objects.

Every dict here is built in a fixed key order and written with `dumps_line`, so the same results
give byte-identical files.
"""

from __future__ import annotations

import enum
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict, Unpack

import orjson

from batchmlx.core.records import BatchRecord, FileRecord
from batchmlx.formats.errors import errors_object

# OpenAI's own line-level messages for requests that never ran.
BATCH_EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
BATCH_CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
# OpenAI writes this for tokens too unlikely to have a finite logprob; JSON has no -inf.
MIN_LOGPROB = -9999.0


class IdPrefix(enum.StrEnum):
    BATCH = "batch_"
    BATCH_REQUEST = "batch_req_"
    FILE = "file-"
    CHAT_COMPLETION = "chatcmpl-"
    COMPLETION = "cmpl-"
    RESPONSE = "resp_"
    MESSAGE = "msg_"


_SEPARATORS = {"batch": "_", "batch_req": "_", "file": "-", "chatcmpl": "-", "cmpl": "-"}


def _random_hex() -> str:
    return secrets.token_hex(12)


def new_id(prefix: str, rand: Callable[[], str] | None = None) -> str:
    """`new_id(IdPrefix.BATCH)` → "batch_3f2a…"; a bare "batch" or "file" gets its separator."""
    prefix = str(prefix)
    if not prefix.endswith(("_", "-")):
        prefix += _SEPARATORS.get(prefix, "_")
    return prefix + (rand or _random_hex)()


@dataclass(frozen=True, slots=True)
class TokenLogprobText:
    """One generated token's logprob, with the token already detokenized."""

    token: str
    logprob: float
    bytes: list[int]  # UTF-8 bytes of the token (a token may be part of a character)
    top: list[tuple[str, float, list[int]]]  # (token, logprob, bytes) best first


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    index: int
    text: str
    finish_reason: str  # "stop" or "length"
    logprobs: list[TokenLogprobText] | None = None


def clamp_logprob(value: float) -> float:
    """A logprob as JSON can hold it: -inf (and anything below) written as MIN_LOGPROB."""
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


def finish_value(reason: Any) -> str:
    return getattr(reason, "value", reason)  # core.request.FinishReason or a plain string


class Envelope(TypedDict):
    """What a chat.completion or text_completion object says around its choices."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    system_fingerprint: NotRequired[str | None]


def completion_object(
    object_type: str, choices: list[dict[str, Any]], **envelope: Unpack[Envelope]
) -> dict[str, Any]:
    """The object both completion endpoints answer with, around their rendered choices."""
    prompt_tokens, completion_tokens = envelope["prompt_tokens"], envelope["completion_tokens"]
    return {
        "id": envelope["id"],
        "object": object_type,
        "created": envelope["created"],
        "model": envelope["model"],
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": envelope["cached_tokens"]},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        "system_fingerprint": envelope.get("system_fingerprint"),
    }


def output_line(
    *, id: str, custom_id: str, status_code: int, request_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """One line of the output (200) or error (4xx/5xx body) file."""
    return {
        "id": id,
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def error_line(*, id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """One line of the error file for a request that never ran (batch_expired, …)."""
    return {
        "id": id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": getattr(code, "value", code), "message": message},
    }


def batch_object(rec: BatchRecord) -> dict[str, Any]:
    """The Batch object exactly as openai.types.Batch types it."""
    usage = rec.usage
    counts = rec.request_counts
    return {
        "id": rec.id,
        "object": "batch",
        "endpoint": rec.endpoint,
        "model": rec.model,
        "errors": errors_object(rec.errors) if rec.errors else None,
        "input_file_id": rec.input_file_id,
        "completion_window": rec.completion_window,
        "status": rec.status.value,
        "output_file_id": rec.output_file_id,
        "error_file_id": rec.error_file_id,
        "created_at": rec.created_at,
        "in_progress_at": rec.in_progress_at,
        "expires_at": rec.expires_at,
        "finalizing_at": rec.finalizing_at,
        "completed_at": rec.completed_at,
        "failed_at": rec.failed_at,
        "expired_at": rec.expired_at,
        "cancelling_at": rec.cancelling_at,
        "cancelled_at": rec.cancelled_at,
        "request_counts": {
            "total": counts.total,
            "completed": counts.completed,
            "failed": counts.failed,
        },
        "metadata": rec.metadata,
        "usage": {
            "input_tokens": usage.input_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
    }


def file_object(f: FileRecord) -> dict[str, Any]:
    """openai.types.FileObject."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": f.expires_at,
    }


def file_deleted_object(file_id: str) -> dict[str, Any]:
    """openai.types.FileDeleted."""
    return {"id": file_id, "object": "file", "deleted": True}


def dumps_line(obj: Any) -> bytes:
    """One JSONL line, newline-terminated; the same object always gives the same bytes."""
    return orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE)
