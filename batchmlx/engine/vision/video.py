"""A video part's bytes → its frames, sampled at the part's fps up to its max_frames (PyAV).

The frames are spread evenly over the whole clip, as mlx-vlm's `load_video` and qwen-vl-utils
take them: a clip of `d` seconds gives round(d * fps) frames, at least one, at most max_frames
(formats.media bounds both) and at most the clip's own frame count. PyAV (its wheel bundles
FFmpeg: no system library) reads the container from the bytes in memory. The frames are decoded
in one pass from the first, and only the sampled ones are converted to RGB, so a container that
seeks badly still gives the right frames; where the container does not say how many frames it
holds, they are counted first by decoding (at most `MAX_SCAN_FRAMES`). A frame larger than
`MAX_FRAME_PIXELS` is scaled down as it is converted, so a request's frames hold at most
max_frames * MAX_FRAME_PIXELS * 3 bytes. No MLX here.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

MAX_FRAME_PIXELS = 1920 * 1080  # pixels of one decoded frame; larger ones are scaled down
MAX_SCAN_FRAMES = 100_000  # frames counted in a container that does not say how many it holds


class VideoUnreadable(ValueError):
    """Bytes PyAV (FFmpeg) cannot decode into frames (the line's 400, named by the caller)."""


@dataclass(frozen=True, slots=True)
class Clip:
    """The sampled frames of one video and what the container said of itself."""

    frames: list[Any]  # RGB uint8 arrays (height, width, 3), in time order
    indices: list[int]  # the sampled frames' positions in the clip
    total_frames: int  # frames in the clip
    source_fps: float  # the clip's own frame rate


def sample_indices(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Positions of the frames to keep: round(duration * fps) of them (at least one, at most
    max_frames and `total`), spread evenly from the first frame to the last."""
    if total <= 0:
        return []
    duration = total / source_fps if source_fps > 0 else total / fps  # no rate: every frame
    n = min(max(1, round(duration * fps)), max_frames, total)
    if n == 1:
        return [0]
    return [round(i * (total - 1) / (n - 1)) for i in range(n)]


def decode_video(data: bytes, fps: float, max_frames: int) -> Clip:
    """The sampled frames of a video's bytes; VideoUnreadable where PyAV decodes none."""
    import av

    try:
        return _decode(av, data, fps, max_frames)
    except VideoUnreadable:
        raise
    # FFmpeg's errors (InvalidDataError for bytes no demuxer knows, …); PyAV raises ValueError
    # (a codec or pixel format it lacks) and EOFError for others
    except (av.error.FFmpegError, ValueError, EOFError, OSError) as exc:
        raise VideoUnreadable(f"FFmpeg cannot decode it: {_reason(exc)}") from None


def _decode(av: Any, data: bytes, fps: float, max_frames: int) -> Clip:
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = _video_stream(container)
        total = int(stream.frames or 0)
        source_fps = _rate(stream)
        if total <= 0:  # some containers (WebM, MKV, raw streams) do not say: count them
            total = sum(1 for _ in _frames(container, stream, MAX_SCAN_FRAMES))
    wanted = sample_indices(total, source_fps, fps, max_frames)
    if not wanted:
        raise VideoUnreadable("FFmpeg decodes no frames from it (not a video it can read)")
    with av.open(io.BytesIO(data), mode="r") as container:
        frames = _read(container, _video_stream(container), wanted)
    if len(frames) < len(wanted):
        raise VideoUnreadable(f"FFmpeg decoded {len(frames)} of the {len(wanted)} frames "
                              f"sampled from its {total} (cut off or damaged)")  # fmt: skip
    return Clip(frames, wanted, total, source_fps)


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        raise VideoUnreadable(f"it holds no video stream (a {container.format.name} container)")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        raise VideoUnreadable("FFmpeg has no decoder for its video stream")
    return stream


def _rate(stream: Any) -> float:
    """The stream's frame rate as FFmpeg guesses it (its r_frame_rate first), 0 where unsaid."""
    for rate in (stream.guessed_rate, stream.average_rate, stream.base_rate):
        if rate:
            value = float(rate)
            if math.isfinite(value) and value > 0:
                return value
    return 0.0


def _frames(container: Any, stream: Any, limit: int) -> Iterator[Any]:
    """The stream's frames in order, at most `limit` of them, from one demux-and-decode pass."""
    for count, frame in enumerate(container.decode(stream)):
        if count >= limit:
            return
        yield frame


def _read(container: Any, stream: Any, wanted: list[int]) -> list[Any]:
    keep = set(wanted)
    frames: list[Any] = []
    for index, frame in enumerate(_frames(container, stream, wanted[-1] + 1)):
        if index in keep:
            frames.append(_rgb(frame))
    return frames


def _rgb(frame: Any) -> Any:
    """One frame as an RGB uint8 array, scaled down (area filter) above MAX_FRAME_PIXELS."""
    width, height = frame.width, frame.height
    if width * height > MAX_FRAME_PIXELS:
        scale = math.sqrt(MAX_FRAME_PIXELS / (width * height))
        width, height = max(1, int(width * scale)), max(1, int(height * scale))
        frame = frame.reformat(width=width, height=height, format="rgb24", interpolation="AREA")
        return frame.to_ndarray()
    return frame.to_ndarray(format="rgb24")


def _reason(exc: BaseException) -> str:
    """FFmpeg's own words for an error (its strerror, without PyAV's errno and file name)."""
    text = str(getattr(exc, "strerror", None) or exc).strip()
    return text or type(exc).__name__
