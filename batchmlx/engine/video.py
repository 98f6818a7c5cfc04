"""A video part's bytes → its frames, sampled at the part's fps up to its max_frames (OpenCV).

The frames are spread evenly over the whole clip, as mlx-vlm's `load_video` and qwen-vl-utils
take them: a clip of `d` seconds gives round(d * fps) frames, at least one, at most max_frames
(formats.media bounds both) and at most the clip's own frame count. Frames are read in one
pass (`grab` every frame, decode only the sampled ones), so a container that seeks badly still
gives the right frames. A frame larger than `MAX_FRAME_PIXELS` is scaled down as it is decoded,
so a request's frames hold at most max_frames * MAX_FRAME_PIXELS * 3 bytes. No MLX here.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import Any

MAX_FRAME_PIXELS = 1920 * 1080  # pixels of one decoded frame; larger ones are scaled down
MAX_SCAN_FRAMES = 100_000  # frames counted in a container that does not say how many it holds


class VideoUnreadable(ValueError):
    """Bytes OpenCV cannot decode into frames (the line's 400, named by the caller)."""


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
    """The sampled frames of a video's bytes; VideoUnreadable where OpenCV reads none."""
    import cv2

    # OpenCV reads containers from a path only
    with tempfile.NamedTemporaryFile(suffix=".video") as tmp:
        tmp.write(data)
        tmp.flush()
        total, source_fps = _probe(cv2, tmp.name)
        wanted = sample_indices(total, source_fps, fps, max_frames)
        if not wanted:
            raise VideoUnreadable("OpenCV finds no frames in it (not a video it can decode)")
        frames = _read(cv2, tmp.name, wanted)
    if len(frames) < len(wanted):
        raise VideoUnreadable(f"OpenCV decoded {len(frames)} of the {len(wanted)} frames "
                              f"sampled from its {total}")  # fmt: skip
    return Clip(frames, wanted, total, source_fps)


def _probe(cv2: Any, path: str) -> tuple[int, float]:
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            raise VideoUnreadable("OpenCV cannot open it (not a video container it knows)")
        total = int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        rate = float(cap.get(cv2.CAP_PROP_FPS) or 0.0)
        if total <= 0:  # some containers do not say: count them
            total = 0
            while total < MAX_SCAN_FRAMES and cap.grab():
                total += 1
        return total, rate if math.isfinite(rate) else 0.0
    finally:
        cap.release()


def _read(cv2: Any, path: str, wanted: list[int]) -> list[Any]:
    cap = cv2.VideoCapture(path)
    frames: list[Any] = []
    try:
        keep = set(wanted)
        for index in range(wanted[-1] + 1):
            if not cap.grab():
                break
            if index not in keep:
                continue
            ok, frame = cap.retrieve()
            if not ok:
                break
            height, width = frame.shape[:2]
            if height * width > MAX_FRAME_PIXELS:
                scale = math.sqrt(MAX_FRAME_PIXELS / (height * width))
                size = (max(1, int(width * scale)), max(1, int(height * scale)))
                frame = cv2.resize(frame, size, interpolation=cv2.INTER_AREA)
            frames.append(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
    finally:
        cap.release()
    return frames
