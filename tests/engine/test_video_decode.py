"""Video bytes → sampled frames (engine/video.py, PyAV; no MLX): which frames an fps and a
max_frames keep, the frames themselves, and the bytes PyAV cannot read."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_vlm import encode_video, random_frames, video

av = pytest.importorskip("av")

from batchmlx.engine.vision import video as video_module  # noqa: E402
from batchmlx.engine.vision.video import VideoUnreadable, decode_video, sample_indices  # noqa: E402


def every_frame(data: bytes) -> list:
    """Each frame of a clip, decoded by PyAV on its own (RGB)."""
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def test_frames_are_spread_over_the_clip_at_the_asked_rate():
    # 8 frames at 4 fps: 2 seconds
    assert sample_indices(8, 4.0, 4.0, 32) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert sample_indices(8, 4.0, 2.0, 32) == [0, 2, 5, 7]  # 2 s at 2 fps: 4 frames
    assert sample_indices(8, 4.0, 30.0, 32) == list(range(8))  # never more than the clip holds
    assert sample_indices(8, 4.0, 4.0, 3) == [0, 4, 7]  # max_frames, still first to last
    assert sample_indices(8, 4.0, 0.1, 32) == [0]  # at least one
    assert sample_indices(300, 30.0, 2.0, 32) == [round(i * 299 / 19) for i in range(20)]
    assert sample_indices(5, 0.0, 2.0, 32) == [0, 1, 2, 3, 4]  # no rate said: every frame
    assert sample_indices(0, 4.0, 2.0, 32) == []


def test_a_clip_decodes_to_its_sampled_frames_in_rgb():
    import numpy as np

    written = random_frames(3)
    data = encode_video(written, fps=4.0)
    clip = decode_video(data, fps=2.0, max_frames=32)
    assert (clip.total_frames, clip.source_fps, clip.indices) == (8, 4.0, [0, 2, 5, 7])
    assert [(f.shape, f.dtype) for f in clip.frames] == [((56, 56, 3), np.uint8)] * 4
    # the same frames PyAV decodes one by one
    every = every_frame(data)
    assert len(every) == 8
    for frame, i in zip(clip.frames, clip.indices, strict=True):
        assert np.array_equal(frame, every[i])
    # and the frames as written, up to the codec's loss (random pixels: JPEG's worst case)
    for frame, i in zip(clip.frames, clip.indices, strict=True):
        err = np.abs(frame.astype(int) - written[i].astype(int)).mean()
        assert err < 64, (i, err)  # far below two unrelated random frames' ~85
        assert err < np.abs(frame.astype(int) - written[(i + 1) % 8].astype(int)).mean()


def test_a_container_that_does_not_say_its_frame_count_is_counted():
    import numpy as np

    data = encode_video(random_frames(4), fps=4.0, container="matroska", codec="mpeg4")
    with av.open(io.BytesIO(data)) as container:
        assert not container.streams.video[0].frames  # MKV does not say
    clip = decode_video(data, fps=2.0, max_frames=32)
    assert (clip.total_frames, clip.source_fps, clip.indices) == (8, 4.0, [0, 2, 5, 7])
    every = every_frame(data)
    for frame, i in zip(clip.frames, clip.indices, strict=True):
        assert np.array_equal(frame, every[i])


def test_a_frame_above_the_pixel_bound_is_scaled_down(monkeypatch):
    monkeypatch.setattr(video_module, "MAX_FRAME_PIXELS", 28 * 28)
    clip = decode_video(video(1), fps=4.0, max_frames=2)
    assert [f.shape for f in clip.frames] == [(28, 28, 3)] * 2


@pytest.mark.parametrize("data", [b"", b"not a video at all", b"\0" * 4096, b"RIFF\0\0\0\0AVI "])
def test_bytes_that_are_no_video_are_refused(data):
    with pytest.raises(VideoUnreadable, match="FFmpeg"):
        decode_video(data, fps=2.0, max_frames=8)


def test_a_container_without_a_video_stream_is_refused():
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        sound = av.AudioFrame.from_ndarray(np.zeros((1, 800), "int16"), format="s16", layout="mono")
        sound.sample_rate = 8000
        out.mux(stream.encode(sound))
        out.mux(stream.encode())
    with pytest.raises(VideoUnreadable, match="no video stream"):
        decode_video(buf.getvalue(), fps=2.0, max_frames=8)


@pytest.mark.parametrize("cut", [2, 8])
def test_a_cut_off_video_is_refused_not_half_read(cut):
    data = video(1)
    with pytest.raises(VideoUnreadable, match="decoded .* of the|cannot decode it"):
        decode_video(data[: len(data) // cut], fps=4.0, max_frames=8)


def test_decoding_imports_no_opencv():
    # batchmlx's video path needs only PyAV's wheel, not OpenCV (whose wheel links system libGL)
    code = (
        "import sys; from tests.tiny_vlm import video; from batchmlx.engine.vision.video import "
        "decode_video; decode_video(video(1), 4.0, 8); print('cv2' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (0, "False"), done.stderr
