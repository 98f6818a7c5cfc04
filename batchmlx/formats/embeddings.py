"""/v1/embeddings: a request body → `EmbeddingsRequest` (or OpenAI's 400), and the list object.

OpenAI takes `input` as a string, an array of strings, an array of token ids or an array of
token-id arrays; at most 2,048 inputs per request and 50,000 across one batch, 8,192 tokens per
input and 300,000 tokens per request. The body's shape is judged here (`parse_embeddings`); its
tokens once the model is known (`check_tokens`: the worker tokenizes, this says what is refused).
"""

from __future__ import annotations

import base64
import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchmlx.core.records import BatchErrorRecord
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import REQUIRED, InputShape, input_shape, is_int, token_id_problem
from batchmlx.formats.request import Endpoint

EMBEDDINGS_URL = Endpoint.EMBEDDINGS.value
MAX_EMBEDDING_INPUTS = 50_000  # across one batch (OpenAI's cap)
MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's cap per request
MAX_TOKENS_PER_INPUT = 8192  # OpenAI's cap on one input (less where the model's context is)
MAX_TOKENS_PER_REQUEST = 300_000  # OpenAI's cap on the tokens of all inputs of one request
INVALID_REQUEST = "invalid_request_error"  # the `type` of most 400s
_KEYS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})


class EncodingFormat(enum.StrEnum):
    FLOAT = "float"
    BASE64 = "base64"  # little-endian float32 bytes, base64-encoded (what the SDK decodes)


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    texts: tuple[str, ...] | None  # inputs given as text
    token_ids: tuple[tuple[int, ...], ...] | None  # inputs given as token ids
    encoding: EncodingFormat
    dimensions: int | None  # keep the first `dimensions` components (renormalized)

    @property
    def count(self) -> int:
        return len(self.texts if self.texts is not None else self.token_ids or ())


class EmbeddingsError(Exception):
    """A body OpenAI would answer with a 400; the worker renders it as its error body."""

    def __init__(
        self, code: ErrorCode, message: str, param: str | None, kind: str = INVALID_REQUEST
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.kind = kind  # the error body's `type`


def count_inputs(value: Any) -> int:
    """How many embeddings one request's `input` asks for."""
    return len(value) if input_shape(value) in (InputShape.TEXTS, InputShape.ID_LISTS) else 1


def check_embeddings_input(body: dict[str, Any]) -> tuple[str, str] | None:
    """The file-validation shape check: (param, problem) or None."""
    if "input" not in body:
        return "body.input", REQUIRED
    if input_shape(body["input"]) is None:
        return "body.input", (
            "must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays"
        )
    return None


def too_many_inputs(count: int) -> BatchErrorRecord:
    return BatchErrorRecord(
        code=ErrorCode.TOO_MANY_EMBEDDING_INPUTS.value,
        message=f"The batch has {count} embedding inputs; /v1/embeddings batches are limited "
        f"to {MAX_EMBEDDING_INPUTS} embedding inputs across all requests.",
    )


def parse_embeddings(body: dict[str, Any]) -> EmbeddingsRequest:
    """Raises EmbeddingsError for a body OpenAI would refuse."""
    for key in body:
        if key not in _KEYS:
            raise EmbeddingsError(
                ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {key}", key
            )
    value = body.get("input")
    if value is None:
        raise EmbeddingsError(
            ErrorCode.MISSING_REQUIRED_PARAMETER, "Missing required parameter: 'input'.", "input"
        )
    shape = input_shape(value)
    if shape is None:
        raise EmbeddingsError(
            ErrorCode.INVALID_TYPE,
            "Invalid type for 'input': expected a string, an array of strings, an array of "
            "token ids or an array of token-id arrays.",
            "input",
        )
    if count_inputs(value) > MAX_INPUTS_PER_REQUEST:
        raise EmbeddingsError(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'input': at most {MAX_INPUTS_PER_REQUEST} inputs per request, got "
            f"{count_inputs(value)}.",
            "input",
        )
    texts: tuple[str, ...] | None = None
    ids: tuple[tuple[int, ...], ...] | None = None
    if shape is InputShape.TEXT:
        texts = (value,)
    elif shape is InputShape.TEXTS:
        texts = tuple(value)
    elif shape is InputShape.IDS:
        ids = (tuple(value),)
    else:
        ids = tuple(tuple(v) for v in value)
    if texts is not None and any(not t for t in texts):
        raise EmbeddingsError(
            ErrorCode.INVALID_VALUE, "Invalid 'input': input cannot be an empty string.", "input"
        )
    problem = None if ids is None else next(filter(None, map(token_id_problem, ids)), None)
    if problem is not None:
        raise EmbeddingsError(ErrorCode.INVALID_VALUE, f"Invalid 'input': {problem}.", "input")
    fmt = body.get("encoding_format")
    try:
        encoding = EncodingFormat(fmt if fmt is not None else EncodingFormat.FLOAT)
    except ValueError:
        raise EmbeddingsError(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for 'encoding_format': {fmt!r}. Supported values are: 'float' and "
            "'base64'.",
            "encoding_format",
        ) from None
    dims = body.get("dimensions")
    if dims is not None and (not is_int(dims) or dims < 1):
        raise EmbeddingsError(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'dimensions': expected an integer >= 1, got {dims!r}.",
            "dimensions",
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise EmbeddingsError(
            ErrorCode.INVALID_TYPE, "Invalid type for 'user': expected a string.", "user"
        )
    return EmbeddingsRequest(texts, ids, encoding, dims)


def check_tokens(
    tokens: Sequence[Sequence[int]], context: int, vocab_size: int | None
) -> EmbeddingsError | None:
    """The refusal of one request's tokenized inputs, in OpenAI's words, or None: an empty
    input, one over `MAX_TOKENS_PER_INPUT` (or the model's context), all of them over
    `MAX_TOKENS_PER_REQUEST`, a token id the model has no embedding for (`vocab_size` rows)."""
    limit = min(context, MAX_TOKENS_PER_INPUT)
    longest = max(len(t) for t in tokens)
    if longest > limit or min(len(t) for t in tokens) == 0:
        return EmbeddingsError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {limit} tokens, however you requested "
            f"{longest} tokens in your input. Please reduce your input.",
            "input",
        )
    total = sum(len(t) for t in tokens)
    if total > MAX_TOKENS_PER_REQUEST:
        return EmbeddingsError(
            ErrorCode.MAX_TOKENS_PER_REQUEST,
            f"Requested {total} tokens, max {MAX_TOKENS_PER_REQUEST} tokens per request",
            None,
            ErrorCode.MAX_TOKENS_PER_REQUEST.value,  # OpenAI's type for this one
        )
    if vocab_size is not None:
        bad = next((t for ids in tokens for t in ids if t >= vocab_size), None)
        if bad is not None:
            return EmbeddingsError(
                ErrorCode.INVALID_VALUE,
                f"Invalid 'input': token id {bad} is out of range; this model's vocabulary has "
                f"{vocab_size} tokens (ids 0 to {vocab_size - 1}).",
                "input",
            )
    return None


def dimensions_error(asked: int, size: int) -> EmbeddingsError:
    return EmbeddingsError(
        ErrorCode.INVALID_VALUE,
        f"Invalid 'dimensions': this model's embeddings have {size} dimensions; {asked} "
        "cannot be served.",
        "dimensions",
    )


def _encode(vector: Sequence[float], encoding: EncodingFormat) -> list[float] | str:
    if encoding is EncodingFormat.BASE64:
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return [float(x) for x in vector]


def embeddings_body(
    *,
    vectors: Sequence[Sequence[float]],
    model: str,
    prompt_tokens: int,
    encoding: EncodingFormat,
) -> dict[str, Any]:
    """The list object (openai.types.CreateEmbeddingResponse)."""
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encode(v, encoding)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
