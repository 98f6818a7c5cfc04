"""The vision engine (engine/vision.py) on a tiny random-weight LLaVA built from mlx-vlm's own
classes: greedy tokens equal mlx-vlm's own generation loop on the same weights and image, alone
and several requests in a row; the prefix cache's three image cases, with `cached_tokens`."""

from __future__ import annotations

import base64

import pytest

from batchmlx.core.request import CacheOutcome, GenerationRequest, SamplingParams
from batchmlx.formats.params import parse_request
from tests.tiny_vlm import IMAGE_TOKENS, png

pytest.importorskip("mlx_vlm")

MAX = 6


@pytest.fixture(scope="module")
def loaded(tiny_vlm_dir):
    from batchmlx.engine.vision.load import load_vision
    from batchmlx.engine.vision.prompter import VisionPrompter

    model, processor, config = load_vision(str(tiny_vlm_dir))
    return model, processor, VisionPrompter(processor, config, "tiny-llava")


def engine(loaded, batched: bool = True, **settings):
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.engine.runners.vision import vision_engine

    model, processor, _ = loaded
    cfg = EngineSettings(cache_max_blocks=256, **settings)
    return vision_engine(model, processor, context_length=2048, config=cfg, batched=batched)


def request(loaded, image: bytes | None, question: str, rid: str) -> GenerationRequest:
    content: list[dict] = [{"type": "text", "text": question}]
    if image is not None:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    parsed = parse_request("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": "You look at pictures."},
        {"role": "user", "content": content}]})  # fmt: skip
    assert not isinstance(parsed, Exception) and hasattr(parsed, "media"), parsed
    tokens, _, spans, inputs = loaded[2].prompt(parsed.messages, parsed.media)
    return GenerationRequest(rid, tokens, SamplingParams(max_tokens=MAX, temperature=0.0),
                             media_spans=spans, media=inputs)  # fmt: skip


def reference(loaded, req: GenerationRequest) -> list[int]:
    """mlx-vlm's own loop (generate_step, what its generate runs) on the same inputs."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    model = loaded[0]
    pixels = None if req.media is None else req.media.pixel_values
    steps = generate_step(mx.array([req.prompt_tokens]), model, pixels, None,
                          max_tokens=MAX, temperature=0.0)  # fmt: skip
    return [int(t) for t, _ in steps]


def test_the_prompt_holds_one_placeholder_run_keyed_by_the_image(loaded):
    a = request(loaded, png(1), "What is this?", "a")
    (span,) = a.media_spans
    assert span.length == IMAGE_TOKENS
    assert a.prompt_tokens[span.start : span.end] == [loaded[2].image_token_id] * IMAGE_TOKENS
    assert request(loaded, png(2), "What is this?", "b").media_spans[0].digest != span.digest


def test_greedy_tokens_equal_mlx_vlm_alone_and_batched(loaded):
    reqs = [request(loaded, png(i), q, f"r{i}") for i, q in
            enumerate(["What is this?", "Name the colours.", "Describe it."])]  # fmt: skip
    refs = [reference(loaded, r) for r in reqs]
    assert len({tuple(r) for r in refs}) > 1  # the image changes the answer
    for batched in (True, False):
        eng = engine(loaded, batched=batched, use_paged_cache=False)
        for r in reqs:
            eng.add(r)
        done, widest = {}, 0
        while eng.has_unfinished():
            done |= {o.request_id: o for o in eng.step()}
            widest = max(widest, eng.counters().running)
        for req, ref in zip(reqs, refs, strict=True):
            out = done[req.request_id]
            assert out.token_ids == ref[: len(out.token_ids)], (batched, out.request_id)
            assert len(out.token_ids) == MAX or out.finish_reason.value == "stop"
        assert widest == (3 if batched else 1)  # batched: the three decoded together
    # continuous: a request joins the decode batch while others are half way
    eng = engine(loaded)
    eng.add(reqs[0])
    eng.add(reqs[1])
    outs = {}
    for _ in range(3):  # a prefill step, its decode step, the second prompt's prefill step
        outs |= {o.request_id: o for o in eng.step()}
    assert eng.counters().running == 2
    eng.add(reqs[2])
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step()}
    for req, ref in zip(reqs, refs, strict=True):
        assert outs[req.request_id].token_ids == ref[: len(outs[req.request_id].token_ids)]
    # a text-only prompt through the same engine
    text = request(loaded, None, "Hello there", "t")
    assert engine(loaded).generate([text])[0].token_ids == reference(loaded, text)[:MAX]


def test_an_aborted_row_leaves_the_batch_and_the_rest_go_on(loaded):
    reqs = [request(loaded, png(i), "What is this?", f"r{i}") for i in range(3)]
    eng = engine(loaded)
    for r in reqs:
        eng.add(r)
    for _ in range(5):  # prefill steps, each but the last followed by a decode step
        eng.step()
    assert eng.counters().running == 3
    assert eng.abort("r1") and not eng.abort("r1")
    outs = {}
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step()}
    assert set(outs) == {"r0", "r2"}
    for r in (reqs[0], reqs[2]):
        assert outs[r.request_id].token_ids == reference(loaded, r)[:MAX]
    assert eng.runner.pool.num_used == 0  # every block released


def test_prefix_cache_same_image_other_image_other_question(loaded):
    eng = engine(loaded)
    first = eng.generate([request(loaded, png(1), "What is this?", "a")])[0]
    assert (first.cache_outcome, first.cached_tokens) == (CacheOutcome.MISS, 0)
    assert eng.runner.vision_runs == 1

    same = request(loaded, png(1), "What is this?", "b")
    again = eng.generate([same])[0]
    assert again.cache_outcome is CacheOutcome.HIT
    assert again.cached_tokens == (len(same.prompt_tokens) - 1) // 16 * 16
    assert again.token_ids == first.token_ids == reference(loaded, same)[:MAX]
    assert eng.runner.vision_runs == 1  # the whole image came from the cache: no vision tower

    other = request(loaded, png(2), "What is this?", "c")
    assert other.prompt_tokens == same.prompt_tokens  # the same tokens, another image
    moved = eng.generate([other])[0]
    span = other.media_spans[0]
    # only the blocks wholly before the image are shared
    assert moved.cached_tokens == span.start // 16 * 16 < span.start + 1
    assert moved.token_ids == reference(loaded, other)[:MAX]
    assert eng.runner.vision_runs == 2

    question = request(loaded, png(1), "Which colour is most common here?", "d")
    reused = eng.generate([question])[0]
    assert reused.cache_outcome is CacheOutcome.PREFIX_HIT
    assert reused.cached_tokens >= question.media_spans[0].end // 16 * 16 > span.start
    assert reused.token_ids == reference(loaded, question)[:MAX]
    assert eng.runner.vision_runs == 2  # the image's last block missed, its features were kept
    # KV is kept for cached blocks only (the partial last blocks were dropped with their request)
    assert set(eng.runner._blocks) == {b.block_id for b in eng.runner.pool.blocks if b.is_cached}


def test_prompts_the_model_cannot_take_are_refused_naming_the_part(loaded):
    from batchmlx.engine.vision.prompter import PromptRefused

    def parts(*content) -> tuple:
        p = parse_request("/v1/chat/completions", {"model": "m", "messages": [
            {"role": "user", "content": [*content, {"type": "text", "text": "Hi"}]}]})  # fmt: skip
        assert not isinstance(p, Exception) and hasattr(p, "media"), p
        return p.messages, p.media

    two = {"type": "image_url", "image_url": "data:image/png;base64," +
           base64.b64encode(png(1)).decode()}  # fmt: skip
    with pytest.raises(PromptRefused) as info:
        loaded[2].prompt(*parts(two, two))
    assert info.value.param == "messages[0].content[1].image_url" and "at most 1" in str(info.value)
    junk = {"type": "image_url", "image_url": "data:image/png;base64," +
            base64.b64encode(b"not a png").decode()}  # fmt: skip
    with pytest.raises(PromptRefused, match="not an image PIL can read"):
        loaded[2].prompt(*parts(junk))
    video = {"type": "video_url", "video_url": "data:video/mp4;base64," +
             base64.b64encode(b"\0\0\0 ftypmp4").decode()}  # fmt: skip
    with pytest.raises(PromptRefused, match=r"'tiny-llava' \(llava\) takes no video") as info:
        loaded[2].prompt(*parts(video))
    assert info.value.param == "messages[0].content[0].video_url"
    assert info.value.code.value == "unsupported_value"


def test_blocks_filled_while_decoding_in_the_batch_are_reused_exactly(loaded):
    """A short prompt decodes beside a longer one (so its row is left-padded) past a block
    boundary; a later prompt holding its prompt and answer reuses the block filled while
    decoding, and still gives mlx-vlm's tokens."""
    from dataclasses import replace

    from batchmlx.core.request import GenerationRequest

    short = request(loaded, png(1), "Hi", "short")
    short = replace(short, params=SamplingParams(max_tokens=24, temperature=0.0))
    long = request(loaded, png(2), "Tell me everything you can see in this picture, please.", "l")
    long = replace(long, params=SamplingParams(max_tokens=30, temperature=0.0))  # outlives short
    assert len(long.prompt_tokens) > len(short.prompt_tokens)
    eng = engine(loaded)
    eng.add(short)
    eng.add(long)
    outs, pads = {}, []
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step()}
        if "short" not in outs and eng.runner._batch is not None:
            pads.append(eng.runner._batch[0].left_padding.tolist()[0])  # the short row's padding
    first = outs["short"]
    assert max(pads) > 0  # it decoded left-padded
    prompt_blocks = (len(short.prompt_tokens)) // 16
    assert len(short.prompt_tokens) + len(first.token_ids) >= (prompt_blocks + 1) * 16 + 1
    follow = GenerationRequest("follow", short.prompt_tokens + first.token_ids,
                               SamplingParams(max_tokens=MAX, temperature=0.0),
                               media_spans=short.media_spans, media=short.media)  # fmt: skip
    out = eng.generate([follow])[0]
    assert out.cached_tokens > prompt_blocks * 16  # a block registered during the decode
    assert out.token_ids == reference(loaded, follow)[:MAX]
