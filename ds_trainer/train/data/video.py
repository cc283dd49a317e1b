"""Video files as a video model trains on them (data.video): each file checked by decoding it whole
with PyAV (FFmpeg's decoders, in PyAV's wheel) and described (frames, frame rate, size), its
training windows cut by the extraction rule for each frame count, and a window's frames decoded when
the sample is encoded.

A window is counted in the clip's frames at the model's frame rate (model.video.fps) when
`data.video.resample` is on: frame k of the resampled clip is source frame round(k * source fps /
model fps), so a 30 fps clip trains at 16 fps with frames dropped (a 10 fps one with frames
repeated). Damage of any kind (not a video, no video stream, no frame decodes, decoding stops
part-way, too large) is a reason, as an image's is: the file is skipped, counted and named, never a
traceback. Torch-free but for `clip_tensor`.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from omegaconf import DictConfig

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")


@dataclass(frozen=True)
class Window:
    """A training clip cut from a video file: `count` frames from frame `start` of the resampled
    clip, resampled by `step` (source frames per resampled frame)."""

    start: int
    count: int
    step: float = 1.0

    def source_frames(self) -> list[int]:
        """The source frame numbers of the window's frames."""
        return [round((self.start + k) * self.step) for k in range(self.count)]

    def name(self) -> str:
        return f"{self.start}+{self.count}@{self.step:g}"


def is_video_name(name: str) -> bool:
    return name.lower().endswith(VIDEO_EXTENSIONS)


def check(read: Callable[[], BinaryIO], limit: int, decode: bool = True) -> str | dict[str, Any]:
    """A video file's description ({frames, fps, width, height}: every frame decoded; with
    `decode=False` the container's own count, which may be 0 when it keeps none) or why it cannot
    train."""
    import av

    try:
        with read() as f:
            data = f.read()
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not data:
        return "empty file"
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # noqa: BLE001 - FFmpeg raises many types for what it cannot open
        return "not a video (unrecognized format)"
    with container:
        if not container.streams.video:
            return "no video stream (an audio file?)"
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
        if width * height > limit:
            return f"too large ({width}x{height} a frame, above data.max_image_pixels={limit})"
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else 0.0
        if not decode:
            return {"frames": int(stream.frames or 0), "fps": fps, "width": width, "height": height}
        frames = 0
        try:
            for frame in container.decode(video=0):
                width, height = frame.width, frame.height
                frames += 1
        except Exception as exc:  # noqa: BLE001 - any of FFmpeg's errors stops a damaged stream
            return (
                f"truncated or corrupt video (decoding stopped after {frames} frame(s): "
                f"{type(exc).__name__})"
            )
    if frames == 0:
        return "no frame decodes (truncated or corrupt video)"
    return {"frames": frames, "fps": fps, "width": width, "height": height}


def resampled(info: dict[str, Any], cfg: DictConfig) -> tuple[int, float]:
    """A clip's frame count at the model's rate and its step in source frames (1 where
    data.video.resample is off or the file gives no rate)."""
    fps, target = float(info.get("fps") or 0.0), float(cfg.model.video.fps)
    if not cfg.data.video.resample or fps <= 0 or abs(fps - target) < 1e-6:
        return int(info["frames"]), 1.0
    step = fps / target
    return int(math.floor((int(info["frames"]) - 1) / step)) + 1, step


def windows(info: dict[str, Any], cfg: DictConfig) -> list[Window]:
    """The training windows of a clip: for each frame count of data.video.frames it holds, those the
    extraction rule cuts (head: the first; chunk: consecutive ones that do not overlap; slide: one
    every data.video.stride frames; uniform: data.video.windows spread evenly). None: the clip is
    shorter than every frame count."""
    v = cfg.data.video
    length, step = resampled(info, cfg)
    out: list[Window] = []
    for count in sorted({int(n) for n in v.frames}):
        if count > length:
            continue
        out += [
            Window(start, count, step)
            for start in starts(length, count, v.extraction.value, int(v.stride), int(v.windows))
        ]
    return out


def starts(length: int, count: int, extraction: str, stride: int, windows_asked: int) -> list[int]:
    """The first frames of the windows of `count` frames in a clip of `length` frames."""
    last = length - count
    if extraction == "head":
        return [0]
    if extraction == "chunk":
        return list(range(0, last + 1, count))
    if extraction == "slide":
        return list(range(0, last + 1, max(1, stride)))
    n = max(1, windows_asked)
    if n == 1 or last == 0:
        return [0]
    return sorted({round(j * last / (n - 1)) for j in range(n)})


def frames(read: Callable[[], BinaryIO], window: Window) -> list[Any]:
    """The window's frames as PIL images (RGB), decoded from the start of the file to its last
    frame."""
    import av

    wanted = window.source_frames()
    positions: dict[int, list[int]] = {}
    for k, n in enumerate(wanted):
        positions.setdefault(n, []).append(k)
    out: list[Any] = [None] * len(wanted)
    with read() as f:
        data = f.read()
    with av.open(io.BytesIO(data), mode="r") as container:
        for n, frame in enumerate(container.decode(video=0)):
            for k in positions.get(n, ()):
                out[k] = frame.to_image().convert("RGB")
            if n >= wanted[-1]:
                break
    missing = [wanted[k] for k, image in enumerate(out) if image is None]
    if missing:
        raise ValueError(f"frame {missing[0]} does not decode (the file changed since its check?)")
    return out


def write(path: Any, pictures: list[Any], fps: float, codec: str = "libx264") -> None:
    """Frames (PIL) to a video file (mp4 with H.264 by default), the size rounded down to even sides
    (yuv420p)."""
    import av
    import numpy as np

    width, height = pictures[0].size
    width, height = width - width % 2, height - height % 2
    with av.open(str(path), mode="w") as container:
        stream: Any = container.add_stream(codec, rate=_rate(fps))  # a video stream
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        for picture in pictures:
            frame = av.VideoFrame.from_ndarray(
                np.asarray(picture.convert("RGB").crop((0, 0, width, height))), format="rgb24"
            )
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _rate(fps: float) -> Any:
    from fractions import Fraction

    return Fraction(fps).limit_denominator(1001)
