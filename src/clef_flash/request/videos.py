"""Videos in a request: decoding with PyAV under hosted-style limits, and the release's video processor (host code).

Accepted forms, each video one of:
- a list of frames, each in any form an image takes (request/images.py: data URIs in a body; PIL images, bytes and
  `Path`s in Python), all of one size;
- a video file: a data URI `data:video/mp4;base64,...` or `data:video/webm;base64,...` in a body; bytes or a
  `pathlib.Path` in Python (a plain string is never read as a path). MP4 (and QuickTime) or WebM (Matroska)
  containers, any codec the FFmpeg inside PyAV's wheel decodes (H.264, HEVC, VP8, VP9, AV1, ...); audio is ignored.

Limits (every refusal is a 422 at `["body", "videos", i]` with what is wrong; a list's frame is named in the message):
  at most 4 videos in a request; 16 MiB each (a file, or a list's encoded frames together) and 16 MiB together;
  at most 1,200 frames in each (a minute at 20 fps), each of at most 1920 x 1088 pixels; at least 2 frames (the
  tower's temporal patch); a list's frames are images (4 MiB each) and hold at most 32 megapixels together, as
  they are kept decoded (160 frames of 448 x 448, 15 of 1080p: send a longer clip as a file, whose frames are
  decoded one at a time and only up to the last one sampled).

Frame sampling and preprocessing are the release's `video_preprocessor_config.json` exactly as transformers'
`Qwen3VLVideoProcessor` (what the release's `AutoProcessor` builds) computes them:
- frames: a file's count and rate are its video stream's (`frames`, `average_rate`, as transformers' PyAV reader
  reads them; a WebM stream, which states no count, is counted); a list is a clip at 24 fps (transformers' rate
  without metadata). With `do_sample_frames`, `fps` frames per second are kept: n = int(frames / rate * fps) within
  [min_frames, max_frames] and at most all, at indices round(linspace(0, frames - 1, n)). So a list of N frames
  keeps max(4, N // 12) of them (all when N <= 4), and a 10 s clip 20.
- timestamps: each pair of frames (the temporal patch) is announced in the prompt as `<t seconds>`, t the mean of
  the two frames' times (index / rate) with one decimal (`Qwen3VLProcessor.replace_video_token`).
- pixels: RGB (a list's frames with alpha blended over white in float, as transformers blends) -> the size by
  `smart_resize` with the temporal factor (multiples of patch x merge; frames x height x width within
  [shortest_edge, longest_edge] pixels; a side under 32 px first scaled up) -> torch's antialiased bicubic
  (on uint8: torchvision's CPU kernel) -> (x - 255 mean) / (255 std) in float32 -> the last frame repeated to an
  even count -> patches [t * h * w, C * 2 * p²], t = frames / 2, in (frame pair, merge block) order.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .images import DataUris, ImageProcessorConfig, MediaProblem, RequestImage, decode_image, encoded_bytes, normalize, patchify, resize

MAX_VIDEOS = 4
MAX_VIDEO_BYTES = 16 * 1024 * 1024
MAX_TOTAL_VIDEO_BYTES = 16 * 1024 * 1024
MAX_VIDEO_FRAMES = 1200
MAX_FRAME_PIXELS = 1920 * 1088
MAX_LIST_PIXELS = 32 * 1024 * 1024
VIDEO_URIS = DataUris("video", ("mp4", "webm"), MAX_VIDEO_BYTES, "16 MiB")
CONTAINERS = {"mp4", "mov", "webm", "matroska"}  # names in PyAV's format names ("mov,mp4,m4a,...", "matroska,webm")
LIST_FRAME_RATE = 24.0  # transformers' rate for frames that come without metadata


@dataclass(frozen=True, eq=False)
class RequestVideo:
    """A video, checked: a list's frames, or a file's bytes (decoded again, only up to the sampled frames, when the
    record is encoded)."""

    frames: tuple[RequestImage, ...] | None  # a list of frames; None for a file
    data: bytes | None = field(repr=False)  # a file; None for a list
    frame_count: int
    frame_rate: float | None  # the stream's average rate; None for a list (or a stream without one)
    size: tuple[int, int]  # (width, height) of a frame
    digest: str  # sha256 of the file, or over the frames' digests
    nbytes: int  # encoded bytes


def _av():
    try:
        import av
    except ImportError:  # pragma: no cover - PyAV is in the vision extra
        raise MediaProblem("video_unsupported", "videos need PyAV: pip install 'clef-flash[vision]'") from None
    return av


def decode_video(value: Any) -> RequestVideo:
    """One video in any accepted form -> a `RequestVideo`, or `MediaProblem`."""
    if isinstance(value, RequestVideo):
        return value
    if isinstance(value, (list, tuple)):
        return _frame_list(value)
    data = encoded_bytes(value, VIDEO_URIS)
    if data is None:
        raise MediaProblem(
            "video_type",
            "a video is a data URI string (data:video/mp4;base64,...) or a list of frames (in Python also bytes or a "
            f"Path); got {type(value).__name__}",
        )
    return _video_file(data)


def _frame_list(values: Sequence[Any]) -> RequestVideo:
    _check_frame_count(len(values))
    frames: list[RequestImage] = []
    pixels = 0
    for index, value in enumerate(values):
        try:
            frame = decode_image(value)
        except MediaProblem as problem:
            raise MediaProblem(problem.kind, f"frame {index}: {problem}") from None
        width, height = frame.image.size
        pixels += width * height
        if pixels > MAX_LIST_PIXELS:
            raise MediaProblem(
                "video_too_many_pixels",
                f"a list's frames may have at most {MAX_LIST_PIXELS} pixels (32 MP) together; frame {index} passes it "
                "(send a longer clip as a video file)",
            )
        frames.append(frame)
    sizes = sorted({frame.image.size for frame in frames})
    if len(sizes) > 1:
        raise MediaProblem("video_frame_sizes", f"a video's frames must all have one size; got {', '.join(f'{w}x{h}' for w, h in sizes)}")
    _check_frame_size(*sizes[0])
    nbytes = sum(frame.nbytes for frame in frames)
    if nbytes > MAX_VIDEO_BYTES:
        raise MediaProblem("video_too_large", f"a video may have at most {MAX_VIDEO_BYTES} bytes (16 MiB); its frames have {nbytes}")
    digest = hashlib.sha256(("frames:" + "".join(frame.digest for frame in frames)).encode()).hexdigest()
    return RequestVideo(tuple(frames), None, len(frames), None, sizes[0], digest, nbytes)


def _video_file(data: bytes) -> RequestVideo:
    """Open the container and read its video stream's header: size, frame count and rate (no frame kept)."""
    av = _av()
    try:
        container = av.open(io.BytesIO(data))
    except Exception:
        raise MediaProblem("video_undecodable", "the video could not be opened as MP4 or WebM") from None
    with container:
        if not CONTAINERS & set(container.format.name.split(",")):
            raise MediaProblem("video_format", f"videos must be MP4 or WebM; got {container.format.long_name or container.format.name}")
        if not container.streams.video:
            raise MediaProblem("video_undecodable", "the file has no video stream")
        stream = container.streams.video[0]
        size = (stream.width, stream.height)
        _check_frame_size(*size)
        frame_count = stream.frames
        if frame_count <= 0:  # WebM states no count: count them (decoding, at most one past the limit)
            frame_count = sum(1 for _ in _decoded(container, MAX_VIDEO_FRAMES + 1))
        _check_frame_count(frame_count)
        rate = float(stream.average_rate) if stream.average_rate else None
    return RequestVideo(None, data, frame_count, rate, size, hashlib.sha256(data).hexdigest(), len(data))


def _decoded(container: Any, limit: int) -> Iterator[Any]:
    """The first `limit` frames of the container's first video stream (a decoding error: undecodable)."""
    try:
        for index, frame in enumerate(container.decode(video=0)):
            if index >= limit:
                return
            yield frame
    except Exception as error:
        raise MediaProblem("video_undecodable", f"the video's frames could not be decoded ({type(error).__name__})") from None


def _check_frame_count(count: int) -> None:
    if count > MAX_VIDEO_FRAMES:
        raise MediaProblem("video_too_many_frames", f"a video may have at most {MAX_VIDEO_FRAMES} frames; got {count if count <= MAX_VIDEO_FRAMES + 1 else 'more'}")
    if count < 2:
        raise MediaProblem("video_too_few_frames", f"a video needs at least 2 frames (the tower reads them in pairs); got {count}")


def _check_frame_size(width: int, height: int) -> None:
    if width * height > MAX_FRAME_PIXELS:
        raise MediaProblem("video_too_many_pixels", f"a video's frames may have at most {MAX_FRAME_PIXELS} pixels (1920x1088); got {width}x{height}")
    if width < 1 or height < 1:
        raise MediaProblem("video_undecodable", f"the video's frames are empty ({width}x{height})")


# ------------------------------------------------------------------------------------------------
# The release's video processor


# Qwen3VLVideoProcessor's own defaults for the keys it shares with the image processor (a config may leave them out).
VIDEO_PROCESSOR_DEFAULTS = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


@dataclass(frozen=True)
class VideoProcessorConfig:
    """`video_preprocessor_config.json` (the keys `Qwen3VLVideoProcessor` reads); `frames` holds the ones it shares
    with the image processor (pixels, patch, temporal patch, merge, mean, std, rescale, resample)."""

    frames: ImageProcessorConfig
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> VideoProcessorConfig:
        if config.get("do_center_crop"):
            raise ValueError("video_preprocessor_config.json: do_center_crop=true is not supported")
        kwargs: dict[str, Any] = {"frames": ImageProcessorConfig.from_dict({**VIDEO_PROCESSOR_DEFAULTS, **config}, "video_preprocessor_config.json")}
        for key in ("fps", "num_frames", "min_frames", "max_frames", "do_sample_frames", "cap_pixels_per_frame", "max_video_tokens"):
            if key in config and (config[key] is not None or key in ("fps", "num_frames")):
                kwargs[key] = config[key]
        if kwargs.get("fps", 2) is not None and kwargs.get("num_frames") is not None:
            raise ValueError("video_preprocessor_config.json: num_frames and fps are mutually exclusive")
        return cls(**kwargs)


def sample_frames(frame_count: int, frame_rate: float | None, config: VideoProcessorConfig) -> tuple[np.ndarray, float]:
    """The indices of the frames kept and the rate of their timestamps, as `Qwen3VLVideoProcessor.sample_frames`."""
    rate = frame_rate or LIST_FRAME_RATE
    if not config.do_sample_frames:
        return np.arange(frame_count), rate
    count = config.num_frames
    if count is None and config.fps is not None:
        count = min(max(int(frame_count / rate * config.fps), config.min_frames), config.max_frames, frame_count)
    if count is None:
        count = min(max(frame_count, config.min_frames), config.max_frames)
    return np.linspace(0, frame_count - 1, count).round().astype(int), rate


def frame_pair_times(indices: Sequence[int], rate: float, temporal_patch: int) -> list[float]:
    """Seconds announced before each frame pair: the mean time of its first and last frame
    (`Qwen3VLProcessor._calculate_timestamps`; the last index repeated to a whole pair)."""
    indices = list(indices)
    indices += [indices[-1]] * (-len(indices) % temporal_patch)
    times = [index / rate for index in indices]
    return [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]


def smart_resize_video(
    frames: int, height: int, width: int, *, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) of the resized frames: multiples of `factor` near the frame's, aspect kept, and
    frames x height x width within [min_pixels, max_pixels] (transformers' Qwen3-VL video `smart_resize`)."""
    if frames < temporal_factor:
        raise MediaProblem("video_too_few_frames", f"a video needs at least {temporal_factor} frames after sampling; got {frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaProblem("video_aspect", f"a video's aspect ratio must be under 200; got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class PreprocessedVideo:
    pixel_values: np.ndarray  # [t * h * w, C * temporal_patch * p²] float32
    grid: tuple[int, int, int]  # (t, h, w): frame pairs, patch rows, patch columns
    times: tuple[float, ...]  # seconds announced before each frame pair


def preprocess_video(video: RequestVideo, config: VideoProcessorConfig) -> PreprocessedVideo:
    """Sample, resize, normalize and patch one video as the release's video processor does."""
    import torch

    indices, rate = sample_frames(video.frame_count, video.frame_rate, config)
    pixels = config.frames
    if video.frames is not None:
        frames = _list_frames(video.frames, indices)  # [T, C, H, W]
        size = _resized_size(len(frames), *frames.shape[-2:], config)
        frames = resize(frames, size)
    else:
        frames = torch.stack(list(_file_frames(video, indices, config)))
    patches, grid = patchify(normalize(frames, pixels), pixels)
    times = [float(time) for time in frame_pair_times(indices, rate, pixels.temporal_patch_size)[: grid[0]]]
    return PreprocessedVideo(patches.numpy(), grid, tuple(times))


def _resized_size(frames: int, height: int, width: int, config: VideoProcessorConfig) -> tuple[int, int]:
    pixels = config.frames
    factor = pixels.patch_size * pixels.merge_size
    max_pixels = pixels.max_pixels
    if config.cap_pixels_per_frame:  # qwen-vl-utils' per-frame cap (transformers' `cap_pixels_per_frame`)
        per_frame = max(min(config.max_video_tokens * factor * factor, pixels.max_pixels // frames), int(pixels.min_pixels * 1.05))
        max_pixels = per_frame * frames
    return smart_resize_video(
        frames, height, width, temporal_factor=pixels.temporal_patch_size, factor=factor, min_pixels=pixels.min_pixels, max_pixels=max_pixels
    )


def _list_frames(frames: Sequence[RequestImage], indices: np.ndarray) -> Any:
    """The sampled frames [T, C, H, W]: uint8 RGB, or float32 RGB when a frame's alpha is below 255 somewhere (blended
    over white as transformers' `convert_to_rgb` blends: (1 - a) 255 + a x, a = alpha / 255)."""
    import torch

    images = [frames[index].image for index in indices]
    # RGBA as transformers reads it; a palette or grey frame with a transparent colour too (transformers fails on
    # those); an RGB frame's transparent colour is ignored, as transformers ignores it
    with_alpha = any("A" in image.getbands() or (image.mode in ("P", "L", "1") and "transparency" in image.info) for image in images)
    mode = "RGBA" if with_alpha else "RGB"
    arrays = [np.asarray(image if image.mode == mode else image.convert(mode)) for image in images]
    video = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
    if not with_alpha or not (video[:, 3] < 255).any():
        return video[:, :3]
    alpha = video[:, 3] / 255.0
    return (1 - alpha[:, None]) * 255 + alpha[:, None] * video[:, :3]


def _file_frames(video: RequestVideo, indices: np.ndarray, config: VideoProcessorConfig) -> Iterator[Any]:
    """The sampled frames of a file, each resized as it is decoded ([C, h, w] uint8): transformers' PyAV reader
    (`frame.to_ndarray(format="rgb24")` of the frames whose index is sampled, decoding up to the last one)."""
    import torch

    av = _av()
    wanted = set(indices.tolist())
    size = first = None
    decoded = 0
    with av.open(io.BytesIO(video.data)) as container:
        for index, frame in enumerate(_decoded(container, int(indices[-1]) + 1)):
            decoded += 1
            if index not in wanted:
                continue
            pixels = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)  # [C, H, W] uint8
            if first is None:
                first = tuple(pixels.shape[-2:])
                size = _resized_size(len(wanted), *first, config)
            elif tuple(pixels.shape[-2:]) != first:
                raise MediaProblem("video_undecodable", f"the video's frame size changes at frame {index}")
            yield resize(pixels[None], size)[0]
    if decoded <= indices[-1]:
        raise MediaProblem("video_undecodable", f"the video ended after {decoded} frames; its stream says {video.frame_count}")
