"""A batch's create request (POST /v1/batches, `batchmlx submit`): its endpoint and metadata
(metadata.priority among them) judged in OpenAI's words. Pure: the server answers a problem as
a 400, the CLI prints it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from batchmlx.core.priority import DEFAULT_BATCH_PRIORITY, MAX_BATCH_PRIORITY, MIN_BATCH_PRIORITY
from batchmlx.formats.errors import ErrorCode, json_type
from batchmlx.formats.request import Endpoint

MAX_METADATA_KEYS = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
PRIORITY_KEY = "priority"  # metadata.priority: the batch's priority (core/priority.py)


@dataclass(frozen=True, slots=True)
class CreateProblem:
    """Why a create request is refused: the fields of OpenAI's error envelope."""

    code: ErrorCode
    message: str
    param: str


def _quoted_list(values: list[str]) -> str:
    """'a', 'b', and 'c': how OpenAI lists the supported values of an enum."""
    quoted = [f"'{v}'" for v in values]
    if len(quoted) <= 2:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + f", and {quoted[-1]}"


def endpoint_problem(endpoint: str) -> CreateProblem | None:
    """None for an endpoint batchmlx serves; else OpenAI's `invalid_value`."""
    if endpoint in tuple(Endpoint):
        return None
    return CreateProblem(
        ErrorCode.INVALID_VALUE,
        f"Invalid value: '{endpoint}'. Supported values are: {_quoted_list(sorted(Endpoint))}.",
        "endpoint",
    )


def metadata_problem(value: Any) -> CreateProblem | None:
    """None for null or up to 16 string pairs within OpenAI's lengths. The type of each value
    is judged before the count, in the object's order (OpenAI's recorded answer: "Invalid type
    for 'metadata.tags': expected a string, but got an array instead.")."""
    if value is None:
        return None
    if not isinstance(value, dict):
        return CreateProblem(
            ErrorCode.INVALID_TYPE,
            f"Invalid type for 'metadata': expected an object, but got {json_type(value)} instead.",
            "metadata",
        )
    for key, item in value.items():
        if not isinstance(item, str):
            return CreateProblem(
                ErrorCode.INVALID_TYPE,
                f"Invalid type for 'metadata.{key}': expected a string, but got "
                f"{json_type(item)} instead.",
                f"metadata.{key}",
            )
    if len(value) > MAX_METADATA_KEYS:
        return CreateProblem(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'metadata': too many properties. Expected an object with at most "
            f"{MAX_METADATA_KEYS} properties, but got an object with {len(value)} properties "
            "instead.",
            "metadata",
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY:
            return CreateProblem(
                ErrorCode.INVALID_VALUE,
                f"Invalid property name in 'metadata': '{key}' is too long. Expected a string "
                f"with maximum length {MAX_METADATA_KEY}, but got a string with length "
                f"{len(key)} instead.",
                f"metadata.{key}",
            )
        if len(item) > MAX_METADATA_VALUE:
            return CreateProblem(
                ErrorCode.INVALID_VALUE,
                f"Invalid 'metadata.{key}': string too long. Expected a string with maximum "
                f"length {MAX_METADATA_VALUE}, but got a string with length {len(item)} "
                "instead.",
                f"metadata.{key}",
            )
    return priority_problem(value.get(PRIORITY_KEY))


_INTEGER = re.compile(r"\s*[+-]?[0-9]{1,4}\s*")  # ASCII digits only (int() takes "1_0", "١")


def _priority(text: str) -> int | None:
    """The integer a priority string writes ("-5", "+3", " 10 "), or None."""
    return int(text) if _INTEGER.fullmatch(text) else None


def priority_problem(text: str | None) -> CreateProblem | None:
    """None for no priority or an integer string within the range; else `invalid_value`
    naming metadata.priority."""
    if text is None:
        return None
    value = _priority(text)
    if value is not None and MIN_BATCH_PRIORITY <= value <= MAX_BATCH_PRIORITY:
        return None
    return CreateProblem(
        ErrorCode.INVALID_VALUE,
        f"Invalid 'metadata.{PRIORITY_KEY}': expected an integer from {MIN_BATCH_PRIORITY} to "
        f"{MAX_BATCH_PRIORITY} as a string (lower runs first), but got {text!r} instead.",
        f"metadata.{PRIORITY_KEY}",
    )


def batch_priority(metadata: dict[str, str] | None) -> int:
    """The priority a batch's (valid) metadata gives it: metadata.priority, else 0."""
    text = (metadata or {}).get(PRIORITY_KEY)
    value = None if text is None else _priority(text)
    return DEFAULT_BATCH_PRIORITY if value is None else value
