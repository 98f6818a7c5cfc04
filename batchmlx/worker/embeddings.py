"""/v1/embeddings requests in the worker: collected as they are claimed, then run together in
one batched pass (no generation loop) and answered with OpenAI's list object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from batchmlx.core.engine_api import EmbedderProtocol
from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.formats.embeddings import (
    EMBEDDINGS_URL,
    EmbeddingsError,
    EmbeddingsRequest,
    dimensions_error,
    embeddings_body,
    parse_embeddings,
)
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.request import RequestError
from batchmlx.worker.translate import error_result, server_error_result


def is_embeddings(endpoint: str) -> bool:
    return endpoint == EMBEDDINGS_URL


@dataclass(slots=True)
class _Job:
    key: int  # queue row id, or an online ticket id (< 0)
    request: EmbeddingsRequest
    tokens: list[list[int]]


class EmbeddingJobs:
    """Embedding requests waiting for the next batched pass."""

    def __init__(self) -> None:
        self._jobs: list[_Job] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def add(
        self, c: ClaimedRequest, tok: Any, context: int, dimensions: int
    ) -> RequestResult | None:
        """Queue a claimed embeddings request; its 400 result when the body is refused."""
        try:
            req = parse_embeddings(c.body)
            if req.dimensions is not None and req.dimensions > dimensions:
                raise dimensions_error(req.dimensions, dimensions)
        except EmbeddingsError as exc:
            return error_result(RequestError(400, exc.code.value, exc.message, exc.param))
        if req.texts is not None:
            tokens = [list(tok.encode(t)) for t in req.texts]
        else:
            tokens = [list(ids) for ids in req.token_ids or ()]
        longest = max(len(t) for t in tokens)
        if longest > context or min(len(t) for t in tokens) == 0:
            msg = (
                f"This model's maximum context length is {context} tokens, however you "
                f"requested {longest} tokens in your input. Please reduce your input."
            )
            return error_result(
                RequestError(400, ErrorCode.CONTEXT_LENGTH_EXCEEDED.value, msg, "input")
            )
        self._jobs.append(_Job(c.id, req, tokens))
        return None

    def run(self, embedder: EmbedderProtocol, model: str) -> list[tuple[int, RequestResult]]:
        """Every waiting request through one batched pass (sorted by length inside)."""
        jobs, self._jobs = self._jobs, []
        flat = [t for j in jobs for t in j.tokens]
        if not flat:
            return []
        try:
            vectors = embedder.embed(flat)
        except Exception as exc:  # the pass failed: its requests fail with it, the rest go on
            err = server_error_result(f"The embedding pass failed: {exc}")
            return [(j.key, err) for j in jobs]
        out: list[tuple[int, RequestResult]] = []
        at = 0
        for j in jobs:
            mine = vectors[at : at + len(j.tokens)]
            at += len(j.tokens)
            if j.request.dimensions is not None:
                mine = [_shorten(v, j.request.dimensions) for v in mine]
            n_tokens = sum(len(t) for t in j.tokens)
            body = embeddings_body(
                vectors=[v.tolist() for v in mine], model=model, prompt_tokens=n_tokens,
                encoding=j.request.encoding,
            )  # fmt: skip
            out.append(
                (j.key, RequestResult(
                    status=RequestStatus.SUCCEEDED, status_code=200, body=body,
                    prompt_tokens=n_tokens,
                ))
            )  # fmt: skip
        return out


def _shorten(v: np.ndarray, dims: int) -> np.ndarray:
    """The first `dims` components, renormalized (as OpenAI shortens its v3 embeddings)."""
    head = v[:dims]
    return head / max(float(np.linalg.norm(head)), 1e-12)
