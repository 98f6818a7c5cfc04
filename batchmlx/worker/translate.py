"""OpenAI request bodies ↔ engine requests: prompts through the model's tokenizer and chat
template on the way in, completion bodies on the way out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from batchmlx.core.finish import cut_at_stop, fits_context
from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.core.request import (
    FinishReason,
    GenerationOutput,
    GenerationRequest,
    TokenLogprob,
)
from batchmlx.formats.chat import chat_completion_body
from batchmlx.formats.completions import text_completion_body
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import token_id_problem
from batchmlx.formats.media import text_only_error
from batchmlx.formats.openai import ChoiceResult, IdPrefix, TokenLogprobText, new_id
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import Endpoint, ParsedRequest, RequestError, context_length_error
from batchmlx.formats.responses import response_body
from batchmlx.formats.structured import schema_error_message
from batchmlx.worker.media import MediaReader, MediaRefused


@dataclass(slots=True)
class PendingRequest:
    """A claimed request whose n choices are running in the engine."""

    claimed: ClaimedRequest
    parsed: ParsedRequest
    prompt_tokens: list[int]
    prompt_text: str  # for echo
    outputs: dict[int, GenerationOutput]  # choice index -> output, filled as choices finish

    @property
    def done(self) -> bool:
        return len(self.outputs) == self.parsed.n


def _is_json(text: str) -> bool:
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        return False
    return True


def choice_id(row_id: int, index: int) -> str:
    return f"{row_id}:{index}"


def parse_choice_id(request_id: str) -> tuple[int, int]:
    row, idx = request_id.split(":")
    return int(row), int(idx)


def error_result(err: RequestError) -> RequestResult:
    return RequestResult(
        status=RequestStatus.FAILED, status_code=err.status_code, body=err.body(), error=None
    )


def server_error_result(message: str, status_code: int = 500) -> RequestResult:
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "server_error"}}  # fmt: skip
    return RequestResult(status=RequestStatus.FAILED, status_code=status_code, body=body)


class Translator:
    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        context_length: int,  # prompt + completion tokens the engine holds
        eos_ids,
        vocab_size: int | None = None,  # the embedding's rows; None: not checked
        grammar_check: Callable[[str], str | None] | None = None,
        vision: Any = None,  # a VisionPrompter (engine/vision/) of a vision-language model
        media: MediaReader | None = None,  # reads https and file images (config.MediaSettings)
    ) -> None:
        self.tok = tokenizer
        self.vision = vision
        self.media = media or MediaReader()
        self.grammar_check = grammar_check  # schema → None, or why it cannot be compiled
        self.model_name = model_name
        self.context_length = context_length
        self.eos_ids = frozenset(eos_ids)
        self.vocab_size = vocab_size

    def check(self, claimed: ClaimedRequest) -> ParsedRequest | RequestResult:
        """A claimed row parsed and checked (no I/O, no tokenizer), or the 400 it gets."""
        parsed = parse_request(claimed.endpoint, claimed.body)
        if isinstance(parsed, RequestError):
            return error_result(parsed)
        if parsed.grammar is not None and self.grammar_check is not None:
            detail = self.grammar_check(parsed.grammar.schema)
            if detail is not None:
                msg = schema_error_message(parsed.grammar, detail)
                err = RequestError(400, ErrorCode.INVALID_VALUE.value, msg, parsed.grammar.param)
                return error_result(err)
        problem = self._bad_token_id(parsed)
        if problem is not None:
            msg = f"Invalid 'prompt': {problem}."
            err = RequestError(400, ErrorCode.INVALID_VALUE.value, msg, "prompt")
            return error_result(err)
        if parsed.media and self.vision is None:  # never a silently dropped image
            return error_result(text_only_error(self.model_name, parsed.media[0]).error)
        return parsed

    def reads_media(self, parsed: ParsedRequest) -> bool:
        """Whether the request's https or file parts must be read first (I/O: the worker reads
        them on its media pool, off the engine's thread, worker/media_pool.py)."""
        return self.vision is not None and MediaReader.unread(parsed.media)

    def prepare(
        self, claimed: ClaimedRequest, parsed: ParsedRequest | None = None
    ) -> tuple[PendingRequest | None, list[GenerationRequest], RequestResult | None]:
        """A claimed row → its engine requests, or the 400 result it gets instead. `parsed`:
        `check`'s answer, its media already read (else they are read here, as tests do)."""
        if parsed is None:
            checked = self.check(claimed)
            if isinstance(checked, RequestResult):
                return None, [], checked
            parsed = checked
        spans: tuple[Any, ...] = ()
        inputs = None
        if parsed.media:
            try:  # the bytes read already: only the request's total is checked here
                parsed = replace(parsed, media=self.media.resolve(parsed.media))
            except MediaRefused as refused:
                return None, [], error_result(refused.error)
        try:
            if self.vision is not None and parsed.messages is not None:
                tokens, text, spans, inputs = self.vision.prompt(parsed.messages, parsed.media)
            else:
                tokens, text = self._prompt(parsed)
        except Exception as exc:  # a template that rejects these messages, an unreadable image
            param = getattr(
                exc, "param", None
            )  # engine/vision/prompter.PromptRefused names the part
            code = getattr(exc, "code", ErrorCode.INVALID_VALUE)
            err = RequestError(400, code.value, f"Invalid prompt: {exc}", param)
            return None, [], error_result(err)
        # the one context check: the engine only bounds generation by the room left
        max_tokens = parsed.sampling.max_tokens
        if not fits_context(len(tokens), self.context_length, max_tokens):
            err = context_length_error(
                self.context_length, len(tokens), parsed.endpoint, max_tokens
            )
            return None, [], error_result(err)
        pending = PendingRequest(claimed, parsed, tokens, text, {})
        gens = []
        for i in range(parsed.n):
            params = parsed.sampling
            if params.seed is not None and i:
                # distinct choices, each still reproducible from the request's seed
                params = replace(params, seed=params.seed + i)
            gens.append(
                GenerationRequest(
                    request_id=choice_id(claimed.id, i),
                    prompt_tokens=tokens,
                    params=params,
                    stop_token_ids=self.eos_ids,
                    grammar=parsed.grammar.schema if parsed.grammar else None,
                    media_spans=spans,
                    media=inputs,
                )
            )
        return pending, gens, None

    def _bad_token_id(self, parsed: ParsedRequest) -> str | None:
        """Why a prompt of token ids cannot run: an id the model has no embedding for (naming
        its vocabulary), or, with the vocabulary unknown, one past int32; else None."""
        ids = parsed.prompt_token_ids
        if ids is None:
            return None
        if self.vocab_size is None:
            return token_id_problem(ids)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is None:
            return None
        return (
            f"token id {bad} is out of range; this model's vocabulary has {self.vocab_size} "
            f"tokens (ids 0 to {self.vocab_size - 1})"
        )

    def _prompt(self, parsed: ParsedRequest) -> tuple[list[int], str]:
        if parsed.messages is not None:  # chat and responses
            messages = [dict(m) for m in parsed.messages or ()]
            text = self.tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            tokens = self.tok.encode(text, add_special_tokens=False)
            return list(tokens), text
        if parsed.prompt_token_ids is not None:
            ids = list(parsed.prompt_token_ids)
            return ids, self.tok.decode(ids)
        text = parsed.prompt or ""
        return list(self.tok.encode(text)), text

    def result(self, p: PendingRequest, now: int) -> RequestResult:
        choices = []
        completion_tokens = 0
        first = p.outputs[0]
        for i in range(p.parsed.n):
            out = p.outputs[i]
            completion_tokens += len(out.token_ids)
            text, finish = self._text(out, p.parsed)
            if p.parsed.echo:
                text = p.prompt_text + text
            lps = self._logprobs(out.logprobs) if p.parsed.logprobs else None
            choices.append(ChoiceResult(i, text, finish, lps))
        usage = dict(
            prompt_tokens=len(p.prompt_tokens),
            completion_tokens=completion_tokens,
            cached_tokens=first.cached_tokens,
        )
        if p.parsed.endpoint is Endpoint.RESPONSES:
            body = response_body(
                id=new_id(IdPrefix.RESPONSE), message_id=new_id(IdPrefix.MESSAGE), created=now,
                model=self.model_name, request=p.claimed.body, choice=choices[0],
                input_tokens=usage["prompt_tokens"], output_tokens=completion_tokens,
                cached_tokens=first.cached_tokens,
            )  # fmt: skip
        elif p.parsed.endpoint is Endpoint.CHAT:
            body = chat_completion_body(
                id=new_id(IdPrefix.CHAT_COMPLETION), created=now, model=self.model_name,
                choices=choices, **usage,
            )  # fmt: skip
        else:
            body = text_completion_body(
                id=new_id(IdPrefix.COMPLETION), created=now, model=self.model_name, choices=choices,
                text_offset=0 if p.parsed.echo else len(p.prompt_text), **usage,
            )  # fmt: skip
        return RequestResult(
            status=RequestStatus.SUCCEEDED,
            status_code=200,
            body=body,
            prompt_tokens=len(p.prompt_tokens),
            cached_tokens=first.cached_tokens,
            completion_tokens=completion_tokens,
            cache_outcome=first.cache_outcome.value,
        )

    def _text(self, out: GenerationOutput, parsed: ParsedRequest) -> tuple[str, str]:
        text, stopped = cut_at_stop(self.tok.decode(out.token_ids), parsed.sampling.stop)
        finish = FinishReason.STOP if stopped else out.finish_reason
        if finish is FinishReason.STOP and parsed.grammar is not None and not _is_json(text):
            # a constrained answer cut short (a stop string, a grammar that failed) is not a
            # finished value: `length` is what OpenAI reports for a cut-off structured answer,
            # the finish its clients check before they parse
            finish = FinishReason.LENGTH
        return text, finish.value

    def _logprobs(self, lps: list[TokenLogprob] | None) -> list[TokenLogprobText]:
        out = []
        for lp in lps or []:
            tok = self._token_text(lp.token_id)
            top = [(self._token_text(t), v, list(self._token_text(t).encode())) for t, v in lp.top]
            out.append(TokenLogprobText(tok, lp.logprob, list(tok.encode()), top))
        return out

    def _token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])
