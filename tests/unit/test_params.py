from __future__ import annotations

import pytest

from batchmlx.core.request import SamplingParams
from batchmlx.formats.completions import COMPLETIONS_DEFAULT_MAX_TOKENS
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import (
    Endpoint,
    ParsedRequest,
    RequestError,
    context_length_error,
)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**body) -> ParsedRequest:
    out = parse_request(CHAT, {"model": "m", "messages": USER, **body})
    assert isinstance(out, ParsedRequest), out
    return out


def compl(**body) -> ParsedRequest:
    out = parse_request(COMPL, {"model": "m", "prompt": "hi", **body})
    assert isinstance(out, ParsedRequest), out
    return out


def chat_error(**body) -> RequestError:
    out = parse_request(CHAT, {"model": "m", "messages": USER, **body})
    assert isinstance(out, RequestError), out
    assert out.status_code == 400
    assert out.type == "invalid_request_error"
    return out


def compl_error(**body) -> RequestError:
    out = parse_request(COMPL, {"model": "m", "prompt": "hi", **body})
    assert isinstance(out, RequestError), out
    assert out.status_code == 400
    return out


def test_chat_defaults():
    p = chat()
    assert p == ParsedRequest(
        endpoint=Endpoint.CHAT,
        messages=({"role": "user", "content": "hi"},),
        prompt=None,
        prompt_token_ids=None,
        n=1,
        sampling=SamplingParams(
            max_tokens=None,
            temperature=1.0,
            top_p=1.0,
            seed=None,
            stop=(),
            logprobs=False,
            top_logprobs=0,
        ),
        logprobs=False,
        top_logprobs=0,
        response_format=None,
        echo=False,
    )


def test_completions_defaults():
    p = compl()
    assert p.endpoint is Endpoint.COMPLETIONS
    assert p.messages is None
    assert p.prompt == "hi"
    assert p.prompt_token_ids is None
    assert p.sampling.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert p.sampling.temperature == 1.0
    assert (p.logprobs, p.top_logprobs, p.echo, p.n) == (False, 0, False, 1)


def test_max_tokens_and_max_completion_tokens():
    assert chat(max_tokens=5).sampling.max_tokens == 5
    assert chat(max_completion_tokens=7).sampling.max_tokens == 7
    assert chat(max_tokens=5, max_completion_tokens=9).sampling.max_tokens == 9
    assert chat(max_tokens=None).sampling.max_tokens is None  # until the context is full
    assert compl(max_tokens=40).sampling.max_tokens == 40
    e = compl_error(max_completion_tokens=5)
    assert (e.code, e.param) == ("unknown_parameter", "max_completion_tokens")


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"max_tokens": 0}, "invalid_value", "max_tokens"),
        ({"max_tokens": "5"}, "invalid_type", "max_tokens"),
        ({"max_tokens": 5.0}, "invalid_type", "max_tokens"),
        ({"max_tokens": True}, "invalid_type", "max_tokens"),
        ({"max_completion_tokens": -1}, "invalid_value", "max_completion_tokens"),
        ({"temperature": 7}, "invalid_value", "temperature"),
        ({"temperature": -0.1}, "invalid_value", "temperature"),
        ({"temperature": "hot"}, "invalid_type", "temperature"),
        ({"top_p": 0}, "invalid_value", "top_p"),
        ({"top_p": 1.5}, "invalid_value", "top_p"),
        ({"seed": 1.5}, "invalid_type", "seed"),
        ({"n": 0}, "invalid_value", "n"),
        ({"n": 129}, "invalid_value", "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "invalid_value", "stop"),
        ({"stop": [""]}, "invalid_value", "stop"),
        ({"stop": 3}, "invalid_type", "stop"),
        ({"stop": ["a", 3]}, "invalid_type", "stop"),
        ({"logprobs": 1}, "invalid_type", "logprobs"),
        ({"top_logprobs": 3}, "invalid_value", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "invalid_value", "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "invalid_value", "response_format.type"),
        ({"response_format": "json"}, "invalid_type", "response_format"),
        (
            {"response_format": {"type": "json_schema"}},
            "missing_required_parameter",
            "response_format.json_schema",
        ),
        ({"stream": True}, "unsupported_value", "stream"),
        ({"stream": "yes"}, "invalid_type", "stream"),
        ({"frequency_penalty": 0.5}, "unsupported_value", "frequency_penalty"),
        ({"presence_penalty": -1}, "unsupported_value", "presence_penalty"),
        ({"presence_penalty": 3}, "invalid_value", "presence_penalty"),
        ({"logit_bias": {"50256": -100}}, "unsupported_value", "logit_bias"),
        ({"logit_bias": [1]}, "invalid_type", "logit_bias"),
        ({"tools": [{"type": "function"}]}, "unsupported_value", "tools"),
        ({"tool_choice": "auto"}, "unsupported_value", "tool_choice"),
        ({"functions": [{}]}, "unsupported_value", "functions"),
        ({"user": 3}, "invalid_type", "user"),
        ({"metadata": "x"}, "invalid_type", "metadata"),
        ({"store": "x"}, "invalid_type", "store"),
        ({"echo": True}, "unknown_parameter", "echo"),
        ({"foo": 1}, "unknown_parameter", "foo"),
    ],
)
def test_chat_400s(body, code, param):
    e = chat_error(**body)
    assert (e.code, e.param) == (code, param)


def test_error_messages_and_body():
    e = chat_error(foo=1)
    assert e.message == "Unrecognized request argument supplied: foo"
    assert e.body() == {
        "error": {
            "message": "Unrecognized request argument supplied: foo",
            "type": "invalid_request_error",
            "param": "foo",
            "code": "unknown_parameter",
        }
    }
    e = chat_error(temperature="hot")
    assert (
        e.message == "Invalid type for 'temperature': expected a decimal, but got a string instead."
    )
    e = chat_error(stream=True)
    assert e.message == "Unsupported value for 'stream': batch requests cannot stream."
    assert chat_error(stop=list("abcde")).message == (
        "Invalid 'stop': at most 4 stop sequences are allowed, got 5."
    )


def test_sampling_parameters():
    p = chat(temperature=0, top_p=0.5, seed=42, stop="END", n=3)
    assert p.sampling.temperature == 0.0
    assert p.sampling.greedy
    assert p.sampling.top_p == 0.5
    assert p.sampling.seed == 42
    assert p.sampling.stop == ("END",)
    assert p.n == 3
    assert chat(temperature=2).sampling.temperature == 2.0
    assert chat(top_p=1).sampling.top_p == 1.0
    assert chat(stop=["a", "b", "c", "d"]).sampling.stop == ("a", "b", "c", "d")
    assert chat(n=128).n == 128
    assert chat(seed=-5).sampling.seed == -5


def test_nulls_are_absent():
    nulls = dict.fromkeys(["temperature", "top_p", "stop", "seed", "n", "max_tokens", "tools"])
    assert chat(**nulls) == chat()


def test_accepted_no_op_parameters():
    p = chat(
        stream=False,
        stream_options={"include_usage": True},
        user="u",
        metadata={"k": "v"},
        store=False,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        parallel_tool_calls=True,
    )
    assert p == chat()


def test_chat_logprobs():
    p = chat(logprobs=True)
    assert (p.logprobs, p.top_logprobs) == (True, 0)
    p = chat(logprobs=True, top_logprobs=20)
    assert (p.logprobs, p.top_logprobs) == (True, 20)
    assert (p.sampling.logprobs, p.sampling.top_logprobs) == (True, 20)
    assert chat(logprobs=False).logprobs is False


def test_completions_logprobs_and_echo():
    p = compl(logprobs=3, echo=True)
    assert (p.logprobs, p.top_logprobs, p.echo) == (True, 3, True)
    assert (p.sampling.logprobs, p.sampling.top_logprobs) == (True, 3)
    p = compl(logprobs=0)
    assert (p.logprobs, p.top_logprobs) == (True, 0)
    assert compl_error(logprobs=6).code == "invalid_value"
    assert compl_error(logprobs=True).code == "invalid_type"
    assert compl_error(echo=1).param == "echo"


def test_completions_other_parameters():
    assert compl(best_of=1).n == 1
    assert compl(best_of=2, n=2).n == 2
    assert compl_error(best_of=3).param == "best_of"
    assert compl(suffix="").prompt == "hi"
    assert compl_error(suffix="end").code == "unsupported_value"
    assert compl_error(response_format={"type": "text"}).code == "unknown_parameter"
    assert compl_error(stream=True).param == "stream"


def test_response_format_kept():
    for fmt in (
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    ):
        assert chat(response_format=fmt).response_format == fmt


def test_messages_normalized():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "sys", "name": "x"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
    ]
    p = parse_request(CHAT, {"model": "m", "messages": messages})
    assert p.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
    )


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        (None, "missing_required_parameter", "messages"),
        ([], "invalid_value", "messages"),
        ("hi", "invalid_type", "messages"),
        ([{"role": "robot", "content": "x"}], "invalid_value", "messages[0].role"),
        ([{"role": "tool", "content": "x"}], "unsupported_value", "messages[0].role"),
        (
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}],
            "unsupported_value",
            "messages[0].tool_calls",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "invalid_type",
            "messages[0].content[0].image_url.url",
        ),
        (
            [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        ([{"role": "user"}], "invalid_type", "messages[0].content"),
    ],
)
def test_bad_messages(messages, code, param):
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    e = parse_request(CHAT, body)
    assert isinstance(e, RequestError)
    assert (e.code, e.param) == (code, param)


def test_completion_prompts():
    assert compl(prompt=["one"]).prompt == "one"
    p = compl(prompt=[1, 2, 3])
    assert (p.prompt, p.prompt_token_ids) == (None, (1, 2, 3))
    assert compl(prompt=[[4, 5]]).prompt_token_ids == (4, 5)
    assert compl(prompt="").prompt == ""


@pytest.mark.parametrize(
    ("prompt", "code"),
    [
        (["a", "b"], "unsupported_value"),
        ([[1], [2]], "unsupported_value"),
        ([], "invalid_value"),
        ([-1], "invalid_value"),
        (3, "invalid_type"),
        ([None], "invalid_type"),
    ],
)
def test_bad_prompts(prompt, code):
    e = compl_error(prompt=prompt)
    assert (e.code, e.param) == (code, "prompt")


def test_missing_prompt():
    e = parse_request(COMPL, {"model": "m"})
    assert (e.code, e.param) == ("missing_required_parameter", "prompt")


def test_bad_endpoint_and_body_do_not_raise():
    e = parse_request("/v1/embeddings", {"model": "m"})
    assert isinstance(e, RequestError)
    assert e.code == "invalid_url"
    assert isinstance(parse_request(CHAT, []), RequestError)


def test_context_length_error():
    e = context_length_error(2048, 2100, Endpoint.CHAT)
    assert e.code == "context_length_exceeded"
    assert e.status_code == 400
    assert e.message == (
        "This model's maximum context length is 2048 tokens. However, your messages resulted in "
        "2100 tokens. Please reduce the length of the messages."
    )
    assert e.param == "messages"
    assert context_length_error(100, 120, Endpoint.COMPLETIONS).param == "prompt"
