"""Videos through the vision engine (engine/vision.py) on a tiny random-weight Qwen2-VL built
from mlx-vlm's own classes (tests/tiny_vlm.py): the frames sampled at the part's fps go through
the model's processor as `videos=`; greedy tokens and their logprobs equal mlx-vlm's own loop on
the same weights and frames, alone and batched beside an image and a text request (M-RoPE
positions per row); the prefix cache's three video cases; the videos that are a 400."""

from __future__ import annotations

import base64

import pytest

from batchmlx.core.request import CacheOutcome, GenerationRequest, SamplingParams
from batchmlx.formats.params import parse_request
from tests.tiny_vlm import png, video

pytest.importorskip("mlx_vlm")
pytest.importorskip("av")

MAX = 6
SYSTEM = "You are a careful assistant who watches short videos and answers in one sentence."
VIDEO_TOKENS = 16  # 8 frames at 56x56: 4 temporal patches of 2x2 merged patches


@pytest.fixture(scope="module")
def loaded(tiny_qwen2_vl_dir):
    from batchmlx.engine.vision.load import load_vision
    from batchmlx.engine.vision.prompter import VisionPrompter

    model, processor, config = load_vision(str(tiny_qwen2_vl_dir))
    return model, processor, VisionPrompter(processor, config, "tiny-qwen2-vl")


def engine(loaded, **settings):
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.engine.runners.vision import vision_engine

    model, processor, _ = loaded
    cfg = EngineSettings(cache_max_blocks=256, **settings)
    return vision_engine(model, processor, context_length=2048, config=cfg)


def video_part(clip: bytes, fps: float = 4.0, max_frames: int = 8) -> dict:
    url = "data:video/x-msvideo;base64," + base64.b64encode(clip).decode()
    return {"type": "video_url", "video_url": {"url": url}, "fps": fps, "max_frames": max_frames}


def image_part(image: bytes) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def parsed(*content: dict, question: str = "What happens?"):
    p = parse_request("/v1/chat/completions", {"model": "m", "messages": [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [*content, {"type": "text", "text": question}]}]})  # fmt: skip
    assert not isinstance(p, Exception) and hasattr(p, "media"), p
    return p.messages, p.media


def request(loaded, *content: dict, question: str = "What happens?", rid: str = "r"):
    tokens, _, spans, inputs = loaded[2].prompt(*parsed(*content, question=question))
    params = SamplingParams(max_tokens=MAX, temperature=0.0, logprobs=True)
    return GenerationRequest(rid, tokens, params, media_spans=spans, media=inputs)


def reference(loaded, req: GenerationRequest) -> list[tuple[int, float]]:
    """mlx-vlm's own loop (generate_step) on the same tokens, pixels and grids: each greedy
    token and its logprob."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    kwargs, pixels = {}, None
    if req.media is not None:
        kwargs = dict(req.media.extra)
        if "video_grid_thw" in kwargs:
            kwargs["pixel_values_videos"] = req.media.pixel_values
        else:
            pixels = req.media.pixel_values
    steps = generate_step(mx.array([req.prompt_tokens]), loaded[0], pixels, None,
                          max_tokens=MAX, temperature=0.0, **kwargs)  # fmt: skip
    return [(int(t), float(lp[int(t)])) for t, lp in steps]


def assert_matches(out, ref) -> None:
    assert out.token_ids == [t for t, _ in ref][: len(out.token_ids)], out.request_id
    assert len(out.token_ids) == MAX or out.finish_reason.value == "stop"
    for got, (_, want) in zip(out.logprobs, ref, strict=False):
        assert got.logprob == pytest.approx(want, abs=1e-4), out.request_id


def test_the_video_is_one_placeholder_run_of_its_sampled_frames(loaded):
    prompter = loaded[2]
    a = request(loaded, video_part(video(1)))
    (span,) = a.media_spans
    assert span.length == VIDEO_TOKENS
    assert a.prompt_tokens[span.start : span.end] == [prompter.video_token_id] * VIDEO_TOKENS
    assert a.media.extra["video_grid_thw"].tolist() == [[4, 4, 4]]  # 8 frames: 4 pairs
    # 2 fps over the 2 s clip: 4 frames, half the tokens; another fps is another cache key
    half = request(loaded, video_part(video(1), fps=2.0))
    assert half.media_spans[0].length == VIDEO_TOKENS // 2
    assert half.media_spans[0].digest != span.digest
    assert request(loaded, video_part(video(1), max_frames=2)).media_spans[0].length == 4
    assert request(loaded, video_part(video(2))).media_spans[0].digest != span.digest


def test_greedy_tokens_equal_mlx_vlm_alone_and_batched_with_an_image_and_text(loaded):
    reqs = [request(loaded, video_part(video(1)), rid="video"),
            request(loaded, image_part(png(1)), question="What is this?", rid="image"),
            request(loaded, video_part(video(2)), question="Name the colours.", rid="video2"),
            request(loaded, rid="text")]  # fmt: skip
    refs = {r.request_id: reference(loaded, r) for r in reqs}
    assert refs["video"] != refs["video2"]  # the video changes the answer
    for r in reqs:  # alone
        assert_matches(engine(loaded).generate([r])[0], refs[r.request_id])
    eng = engine(loaded)
    for r in reqs:
        eng.add(r)
    done, widest = {}, 0
    while eng.has_unfinished():
        done |= {o.request_id: o for o in eng.step()}
        widest = max(widest, eng.counters().running)
    assert widest == len(reqs)  # all four decoded in one batch
    for r in reqs:
        assert_matches(done[r.request_id], refs[r.request_id])
    # the positions after the video are compressed (M-RoPE): 16 tokens span 4 positions
    eng = engine(loaded)
    eng.add(reqs[0])
    eng.step()
    assert eng.runner._running[0].slot.rope_delta == 4 - VIDEO_TOKENS


def test_prefix_cache_same_video_another_question_another_video(loaded):
    eng = engine(loaded)
    first = eng.generate([request(loaded, video_part(video(1)), rid="a")])[0]
    assert (first.cache_outcome, first.cached_tokens, eng.runner.vision_runs) == (
        CacheOutcome.MISS,
        0,
        1,
    )

    same = request(loaded, video_part(video(1)), rid="b")
    again = eng.generate([same])[0]
    assert again.cache_outcome is CacheOutcome.HIT
    assert again.cached_tokens == (len(same.prompt_tokens) - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    assert_matches(again, reference(loaded, same))
    assert eng.runner.vision_runs == 1  # the whole video came from the cache: no vision tower

    question = request(loaded, video_part(video(1)), question="Which colour is most common in "
                       "this clip, and does it change?", rid="c")  # fmt: skip
    span = question.media_spans[0]
    reused = eng.generate([question])[0]
    assert reused.cache_outcome is CacheOutcome.PREFIX_HIT
    assert reused.cached_tokens >= span.end // 16 * 16 > span.start  # the video's blocks
    assert_matches(reused, reference(loaded, question))
    assert eng.runner.vision_runs == 1  # its last block missed; the video's features were kept

    other = request(loaded, video_part(video(2)), rid="d")
    assert other.prompt_tokens == same.prompt_tokens  # the same tokens, another video
    moved = eng.generate([other])[0]
    assert moved.cached_tokens == span.start // 16 * 16 > 0  # only the blocks before it
    assert moved.cache_outcome is CacheOutcome.PREFIX_HIT
    assert_matches(moved, reference(loaded, other))
    assert eng.runner.vision_runs == 2

    slower = request(loaded, video_part(video(1), fps=2.0), rid="e")  # another key
    assert eng.generate([slower])[0].cached_tokens == span.start // 16 * 16
    assert eng.runner.vision_runs == 3


def test_videos_the_model_cannot_take_are_refused_naming_the_part(loaded):
    from batchmlx.engine.vision.prompter import PromptRefused

    where = "messages[1].content[0].video_url.url"
    for junk in (b"not a video", video(1)[:600]):
        with pytest.raises(PromptRefused, match="not a video PyAV can decode") as info:
            loaded[2].prompt(*parsed(video_part(junk)))
        assert (info.value.param, info.value.code.value) == (where, "invalid_value")
    # frames smaller than one merged patch (28 pixels): the processor's refusal, named
    with pytest.raises(PromptRefused, match="processor cannot take") as info:
        loaded[2].prompt(*parsed(video_part(video(1, size=16))))
    assert info.value.param == where
    # mlx-vlm's Qwen2-VL runs its vision tower over images or videos in one prompt, not both
    with pytest.raises(PromptRefused, match="not both") as info:
        loaded[2].prompt(*parsed(image_part(png(1)), video_part(video(1))))
    assert info.value.param == "messages[1].content[1].video_url.url"
    assert info.value.code.value == "unsupported_value"
