"""Structured outputs, the wire side: `response_format` (chat) and `text.format` (responses) →
the JSON schema decoding is constrained to, or the 400 OpenAI would answer.

The engine compiles the schema (`engine/grammar.py`); here it is parsed and made canonical, so
equal schemas written with different key order or spacing share one compiled grammar, and two
schemas are refused at the edge: one over `MAX_SCHEMA_BYTES`, and one that no finite JSON value
satisfies (`admits_finite_value`), which would leave decoding nothing to finish.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from batchmlx.formats.errors import ErrorCode

# OpenAI's rule for a response format's name
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# json_object asks for any JSON object
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
MAX_SCHEMA_BYTES = 256 * 1024  # a schema's canonical JSON text; compiled, it costs ~50x this
_MAX_ROUNDS = 64  # fixed-point rounds of the finiteness check before it gives up (accepts)


class FormatKind(enum.StrEnum):
    TEXT = "text"
    JSON_OBJECT = "json_object"
    JSON_SCHEMA = "json_schema"


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a constrained request must produce."""

    kind: FormatKind  # JSON_OBJECT or JSON_SCHEMA
    schema: str  # the schema's compact JSON text, its key order kept (see canonical_schema)
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
    """The schema as compact JSON text, in the order it was written: llguidance emits the
    properties in the order of `properties`, and OpenAI's answers follow the schema's order
    (sorted keys made every answer's properties alphabetical)."""
    return orjson.dumps(schema).decode()


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
    text = canonical_schema(schema)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise FormatError(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{at}.schema': the schema is {len(text.encode())} bytes as compact JSON; "
            f"at most {MAX_SCHEMA_BYTES} bytes are accepted.",
            f"{at}.schema",
        )
    if not admits_finite_value(schema):
        raise FormatError(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{at}.schema': no finite JSON value satisfies this schema (a required "
            "property or item refers back to itself, through '$ref', with no way to end).",
            f"{at}.schema",
        )
    return Grammar(FormatKind.JSON_SCHEMA, text, name, param)


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


def admits_finite_value(schema: Any) -> bool:
    """Whether some finite JSON value can satisfy `schema`, judged from its structure: `$ref`,
    `allOf`/`anyOf`/`oneOf`, `type`, the `required` properties of objects and the `minItems`
    items of arrays. Other keywords (bounds, patterns, enum members) count as satisfiable: this
    refuses only a schema whose every value would have to nest without end, such as
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"], "type": "object"}.

    The least fixed point over the `$ref` targets: each starts unsatisfiable, and is made
    satisfiable when its schema is under what is known so far, until nothing changes."""
    known: dict[str, bool] = {}
    try:
        for _ in range(_MAX_ROUNDS):
            round_ = _Finite(schema, known)
            root_ok = round_.ok(schema)
            merged = {**known, **round_.found}  # a ref's value only grows round to round
            if merged == known:
                return root_ok
            known = merged
    except RecursionError:  # nested past Python's stack: let the compiler judge it
        return True
    return True


class _Finite:
    """One round of `admits_finite_value`: each `$ref` met is judged once, a ref met again
    while it is being judged (a cycle) by what the round before found (False at first)."""

    def __init__(self, root: Any, known: dict[str, bool]) -> None:
        self.root, self.known = root, known
        self.found: dict[str, bool] = {}
        self._open: set[str] = set()

    def ok(self, node: Any) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: the compiler says what is wrong with it
        ref = node.get("$ref")
        if isinstance(ref, str) and not self._ref(ref):
            return False
        if any(not self.ok(s) for s in _subs(node, "allOf")):
            return False
        for key in ("anyOf", "oneOf"):
            subs = _subs(node, key)
            if key in node and not any(self.ok(s) for s in subs):
                return False
        if "enum" in node:
            return node["enum"] != []
        if "const" in node:
            return True
        types = node.get("type")
        kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if kinds is None:  # no type: a value of a type this node does not constrain will do
            return True
        return any(self._kind_ok(node, kind) for kind in kinds)

    def _kind_ok(self, node: dict[str, Any], kind: Any) -> bool:
        if kind == "object":
            props = node.get("properties")
            props = props if isinstance(props, dict) else {}
            extra = node.get("additionalProperties", True)
            required = node.get("required")
            names = required if isinstance(required, list) else []
            return all(self.ok(props.get(n, extra)) for n in names if isinstance(n, str))
        if kind == "array":
            least = node.get("minItems", 0)
            least = least if isinstance(least, int) else 0
            prefix = _subs(node, "prefixItems")
            items = node.get("items", True)
            if isinstance(items, list):  # the old spelling of prefixItems
                prefix, items = items, node.get("additionalItems", True)
            # the first `least` items must exist; past the prefix they share one schema
            count = min(least, len(prefix) + 1)
            return all(self.ok(prefix[i] if i < len(prefix) else items) for i in range(count))
        return True

    def _ref(self, ref: str) -> bool:
        if ref in self.found:
            return self.found[ref]
        if ref in self._open:
            return self.known.get(ref, False)
        self._open.add(ref)
        target = _resolve(self.root, ref)
        self.found[ref] = True if target is _UNRESOLVED else self.ok(target)
        self._open.discard(ref)
        return self.found[ref]


_UNRESOLVED = object()


def _subs(node: dict[str, Any], key: str) -> list[Any]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _resolve(root: Any, ref: str) -> Any:
    """A local JSON pointer (`#`, `#/$defs/x`); _UNRESOLVED for anything else (anchors, other
    documents), which the finiteness check then takes as satisfiable."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _UNRESOLVED
    node = root
    for raw in ref[2:].split("/"):
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node
