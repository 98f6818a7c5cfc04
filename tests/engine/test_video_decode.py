"""Video bytes → sampled frames (engine/video.py, OpenCV; no MLX): which frames an fps and a
max_frames keep, the frames themselves, and the bytes OpenCV cannot read."""

from __future__ import annotations

import tempfile

import pytest

from tests.tiny_vlm import video

cv2 = pytest.importorskip("cv2")

from batchmlx.engine.video import VideoUnreadable, decode_video, sample_indices  # noqa: E402


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

    data = video(3, frames=8, fps=4.0)
    clip = decode_video(data, fps=2.0, max_frames=32)
    assert (clip.total_frames, clip.source_fps, clip.indices) == (8, 4.0, [0, 2, 5, 7])
    assert [f.shape for f in clip.frames] == [(56, 56, 3)] * 4
    # the same frames OpenCV reads one by one (BGR → RGB)
    cap = cv2.VideoCapture()
    with tempfile.NamedTemporaryFile(suffix=".avi") as tmp:
        tmp.write(data)
        tmp.flush()
        cap.open(tmp.name)
        every = [cv2.cvtColor(cap.read()[1], cv2.COLOR_BGR2RGB) for _ in range(8)]
    for frame, i in zip(clip.frames, clip.indices, strict=True):
        assert np.array_equal(frame, every[i])


@pytest.mark.parametrize("data", [b"not a video at all", b"\0" * 4096, b"RIFF\0\0\0\0AVI "])
def test_bytes_that_are_no_video_are_refused(data):
    with pytest.raises(VideoUnreadable):
        decode_video(data, fps=2.0, max_frames=8)


def test_a_cut_off_video_is_refused_not_half_read():
    data = video(1)
    with pytest.raises(VideoUnreadable, match="decoded|no frames|cannot open"):
        decode_video(data[: len(data) // 2], fps=4.0, max_frames=8)
