"""/v1/embeddings requests in the worker: judged as they are claimed (a 400 for that request
only), then run in bounded slices and answered with OpenAI's list object.

A wave is every request waiting when the last one ended: its inputs go to the embedder together
(sorted by length inside, so short inputs of different requests share passes), and each `run`
advances it by one slice, a forward pass of at most `engine.embed.SLICE_TOKENS` tokens, so the
worker steps generation between slices. A request is answered as soon as its last input is done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchmlx.core.engine_api import EmbedderProtocol
from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.formats.embeddings import (
    EMBEDDINGS_URL,
    EmbeddingsError,
    EmbeddingsRequest,
    check_tokens,
    dimensions_error,
    embeddings_body,
    parse_embeddings,
)
from batchmlx.formats.request import RequestError
from batchmlx.worker.translate import Translator, error_result, server_error_result


def is_embeddings(endpoint: str) -> bool:
    return endpoint == EMBEDDINGS_URL


@dataclass(slots=True)
class _Job:
    key: int  # queue row id, or an online ticket id (< 0)
    request: EmbeddingsRequest
    tokens: list[list[int]]
    vectors: dict[int, np.ndarray] = field(default_factory=dict)  # input index -> vector

    @property
    def done(self) -> bool:
        return len(self.vectors) == len(self.tokens)


@dataclass(slots=True)
class _Wave:
    jobs: list[_Job]
    slices: Iterator[list[tuple[int, Any]]]
    owner: list[tuple[_Job, int]]  # flat input index -> (its job, its index there)


# a wave of at least this many tokens is large: once it ends, the worker gives the memory its
# passes freed back to the OS (engine/host/memory.py); a small request's wave does not pay that
LARGE_WAVE_TOKENS = 4096


class EmbeddingJobs:
    """Embedding requests waiting for, or in, the running wave of slices."""

    def __init__(self) -> None:
        self._jobs: list[_Job] = []  # waiting for the next wave
        self._wave: _Wave | None = None
        self.large_wave_ended = False  # set when a large wave ends; the worker clears it

    def __bool__(self) -> bool:
        return bool(self._jobs) or self._wave is not None

    def add(self, c: ClaimedRequest, tr: Translator, dimensions: int) -> RequestResult | None:
        """Queue a claimed embeddings request; its 400 result when the body is refused."""
        try:
            req = parse_embeddings(c.body)
            if req.dimensions is not None and req.dimensions > dimensions:
                raise dimensions_error(req.dimensions, dimensions)
            if req.texts is not None:
                tokens = [list(tr.tok.encode(t)) for t in req.texts]
            else:
                tokens = [list(ids) for ids in req.token_ids or ()]
            refused = check_tokens(tokens, tr.context_length, tr.vocab_size)
            if refused is not None:
                raise refused
        except EmbeddingsError as exc:
            return error_result(
                RequestError(400, exc.code.value, exc.message, exc.param, type=exc.kind)
            )
        self._jobs.append(_Job(c.id, req, tokens))
        return None

    def run(self, embedder: EmbedderProtocol, model: str) -> list[tuple[int, RequestResult]]:
        """One slice of the wave (a new wave of every waiting request when none runs): the
        requests whose last input it finished, answered."""
        wave = self._wave
        if wave is None:
            if not self._jobs:
                return []
            jobs, self._jobs = self._jobs, []
            owner = [(j, i) for j in jobs for i in range(len(j.tokens))]
            flat = [t for j in jobs for t in j.tokens]
            wave = self._wave = _Wave(jobs, iter(embedder.slices(flat)), owner)
        try:
            done = next(wave.slices)
        except StopIteration:
            done = []
            self._end_wave()
        except Exception as exc:  # the pass failed: the wave's requests fail, the rest go on
            self._end_wave()
            err = server_error_result(f"The embedding pass failed: {exc}")
            return [(j.key, err) for j in wave.jobs if not j.done]
        out: list[tuple[int, RequestResult]] = []
        for flat_index, vector in done:
            job, i = wave.owner[flat_index]
            job.vectors[i] = vector
            if job.done:
                out.append((job.key, _result(job, model)))
        if self._wave is not None and all(j.done for j in wave.jobs):
            self._end_wave()  # nothing left to run: do not wait for a pass to say so
        return out

    def _end_wave(self) -> None:
        wave, self._wave = self._wave, None
        if wave is not None:
            tokens = sum(len(t) for j in wave.jobs for t in j.tokens)
            self.large_wave_ended |= tokens >= LARGE_WAVE_TOKENS


def _result(job: _Job, model: str) -> RequestResult:
    mine = [job.vectors[i] for i in range(len(job.tokens))]
    if job.request.dimensions is not None:
        mine = [_shorten(v, job.request.dimensions) for v in mine]
    n_tokens = sum(len(t) for t in job.tokens)
    body = embeddings_body(
        vectors=[v.tolist() for v in mine], model=model, prompt_tokens=n_tokens,
        encoding=job.request.encoding,
    )  # fmt: skip
    return RequestResult(
        status=RequestStatus.SUCCEEDED, status_code=200, body=body, prompt_tokens=n_tokens
    )


def _shorten(v: np.ndarray, dims: int) -> np.ndarray:
    """The first `dims` components, renormalized (as OpenAI shortens its v3 embeddings)."""
    head = v[:dims]
    return head / max(float(np.linalg.norm(head)), 1e-12)
