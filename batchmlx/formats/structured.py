"""Structured outputs, the wire side: `response_format` (chat) and `text.format` (responses) →
the JSON schema decoding is constrained to, or the 400 OpenAI would answer.

The engine compiles the schema (`engine/grammar.py`); here it is only parsed and made canonical,
so equal schemas written with different key order or spacing share one compiled grammar.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from batchmlx.formats.errors import ErrorCode

# OpenAI's rule for a response format's name
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# json_object asks for any JSON object
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


class FormatKind(enum.StrEnum):
    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a constrained request must produce."""

    kind: FormatKind  # JSON_OBJECT or JSON_SCHEMA
    schema: str  # canonical JSON text of the schema (sorted keys, compact)
    name: str  # the format's name (json_schema), or "json_object"
    param: str  # where it came from: "response_format" or "text.format"


class FormatError(Exception):
    """A response format OpenAI would refuse; params/responses turn it into their 400."""

    def __init__(self, code: ErrorCode, message: str, param: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def canonical_schema(schema: dict[str, Any]) -> str:
    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode()


def _kind(fmt: Any, param: str) -> FormatKind:
    if not isinstance(fmt, dict):
        raise FormatError(
            ErrorCode.INVALID_TYPE,
            f"Invalid type for '{param}': expected an object.",
            param,
        )
    try:
        return FormatKind(str(fmt.get("type")))
    except ValueError:
        raise FormatError(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for '{param}.type': {fmt.get('type')!r}. Supported values are: "
            "'text', 'json_object' and 'json_schema'.",
            f"{param}.type",
        ) from None


def _schema_fields(spec: dict[str, Any], at: str, param: str) -> Grammar:
    """`spec` holds name, schema, strict (nested under json_schema for chat, flat for
    responses); `at` is its param path."""
    name = spec.get("name")
    if name is None:
        raise FormatError(
            ErrorCode.MISSING_REQUIRED_PARAMETER,
            f"Missing required parameter: '{at}.name'.",
            f"{at}.name",
        )
    if not isinstance(name, str) or not _NAME.match(name):
        raise FormatError(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{at}.name': string does not match pattern. Expected a string that "
            "matches the pattern '^[a-zA-Z0-9_-]+$' of at most 64 characters.",
            f"{at}.name",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FormatError(
            ErrorCode.INVALID_TYPE,
            f"Invalid type for '{at}.strict': expected a boolean.",
            f"{at}.strict",
        )
    schema = spec.get("schema")
    if schema is None:
        schema = {}  # OpenAI: an absent schema allows any JSON value
    if not isinstance(schema, dict):
        raise FormatError(
            ErrorCode.INVALID_TYPE,
            f"Invalid type for '{at}.schema': expected an object.",
            f"{at}.schema",
        )
    return Grammar(FormatKind.JSON_SCHEMA, canonical_schema(schema), name, param)


def chat_grammar(fmt: Any, param: str = "response_format") -> Grammar | None:
    """`response_format` of chat/completions: None for text (or absent)."""

    def schema(fmt: dict[str, Any]) -> Grammar:
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise FormatError(
                ErrorCode.MISSING_REQUIRED_PARAMETER,
                f"Missing required parameter: '{param}.json_schema'.",
                f"{param}.json_schema",
            )
        return _schema_fields(spec, f"{param}.json_schema", param)

    return _grammar(fmt, param, schema)


def responses_grammar(fmt: Any, param: str = "text.format") -> Grammar | None:
    """`text.format` of responses: the json_schema fields sit beside `type`."""
    return _grammar(fmt, param, lambda fmt: _schema_fields(fmt, param, param))


def _grammar(
    fmt: Any, param: str, json_schema: Callable[[dict[str, Any]], Grammar]
) -> Grammar | None:
    """None for text (or absent), any JSON object, or what `json_schema` reads from `fmt`."""
    if fmt is None:
        return None
    kind = _kind(fmt, param)
    if kind is FormatKind.TEXT:
        return None
    if kind is FormatKind.JSON_OBJECT:
        return Grammar(kind, canonical_schema(ANY_OBJECT_SCHEMA), kind.value, param)
    return json_schema(fmt)


def schema_error_message(grammar: Grammar, detail: str) -> str:
    """The 400's message when the schema cannot be compiled; `detail` names the keyword."""
    return f"Invalid schema for {grammar.param} '{grammar.name}': {detail}"
